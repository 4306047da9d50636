"""Session 34's probe: every sha256 the pack's process computes is BLAKE3 instead (what BLAKE3 file digests would
cost). PYTHONPATH=this folder; not the tool's code."""
import hashlib

import blake3

hashlib.sha256 = blake3.blake3
