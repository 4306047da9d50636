"""Pausing the cyclic garbage collector while many small acyclic objects are made (a leaf module)."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while many small objects are made (headers, the plan): its
    collections, triggered by allocation counts, walk every live object again and again (measured on the
    released K3's 500,000 tensors: half the time of reading the headers). The objects made hold no cycles."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
