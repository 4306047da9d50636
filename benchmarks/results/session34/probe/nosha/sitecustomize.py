"""Session 34's probe: every sha256 the pack's process computes is a no-op (the floor of any file digest).
PYTHONPATH=this folder; not the tool's code."""
import hashlib


class _Noop:
    name = "sha256"
    digest_size = 32

    def __init__(self, data=b"", **kw):
        pass

    def update(self, d):
        pass

    def hexdigest(self):
        return "0" * 64

    def digest(self):
        return b"\0" * 32

    def copy(self):
        return self


hashlib.sha256 = _Noop
