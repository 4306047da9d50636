"""How a path the user named is checked, and the one form its errors take in every subcommand:
``PATH: does not exist``, ``PATH: is a file, expected a checkpoint folder``, ``PATH: is a folder,
expected an exclude file``. The CLI runs these as click callbacks (so a bad path is refused before
any work, and never in click's own wording) and the library functions run them too."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConvertError


def folder(path: str | os.PathLike, what: str = "a checkpoint folder") -> Path:
    """An existing folder."""
    p = Path(path)
    if not p.exists():
        raise ConvertError(f"{shown(path)}: does not exist")
    if not p.is_dir():
        raise ConvertError(f"{shown(path)}: is a file, expected {what}")
    return p


def output_folder(path: str | os.PathLike) -> Path:
    """A folder to write into: absent (it is created) or a folder."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConvertError(f"{shown(path)}: is a file, expected an output folder")
    return p


def file(path: str | os.PathLike, what: str) -> Path:
    """An existing regular file."""
    p = Path(path)
    if not p.exists():
        raise ConvertError(f"{shown(path)}: does not exist")
    if p.is_dir():
        raise ConvertError(f"{shown(path)}: is a folder, expected {what}")
    return p


def output_file(path: str | os.PathLike) -> Path:
    """A file to write: absent or a file."""
    p = Path(path)
    if p.is_dir():
        raise ConvertError(f"{shown(path)}: is a folder, expected a file to write")
    return p


def existing(path: str | os.PathLike) -> Path:
    """A file or a folder (``inspect`` takes either)."""
    p = Path(path)
    if not p.exists():
        raise ConvertError(f"{shown(path)}: does not exist")
    return p


def shown(path: str | os.PathLike) -> str:
    """The path as the user typed it, without a trailing slash (``out/`` + ``/x`` is not ``out//x``)."""
    text = os.fspath(path)
    return text.rstrip("/") or "/"
