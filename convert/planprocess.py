"""A large input's plan made in a child process, and sent back whole (its table too, unless the plan is banked).

Why: reading half a million headers' entries and walking them to plan leaves this process's allocator holding the
pages it freed, scattered among the objects it keeps: at the released K3's shape 258 MB resident after the banked
plan, of which the table's columns are 63 MB (``benchmarks/plan_memory.py``). A pack carries that for its hours
beside its buffers, and it was most of the whole release's excess over a 10 GB input's peak (issue 43). Made in a
spawned child, the plan arrives here packed, as a pickle is read; the holes end with the child. Where the plan is
banked (each wave's jobs made from its outline) the table stays there too, and is read again only if something asks
for it (``Checkpoint.drop_table``). A small input is planned in this process (``Tuning.plan_apart``): a child's start
and the pickle's way back (1.3 s more at the release's shape) buy it nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from . import filenames, mistral_checkpoint
from .checkpoint import Checkpoint
from .errors import ConvertError
from .options import Options
from .plan import Plan
from .sources import Source
from .workers import die_with


def worth_it(source: Source, index_bytes: int) -> bool:
    """Whether ``source``'s index (HF's or Mistral's) is at least ``index_bytes`` long: the table's size, known
    before any header is read (the released K3's: 59 MB for 497,220 tensors). 0: always; no index: never."""
    sizes = [e.size for e in map(source.entry, (filenames.INDEX, mistral_checkpoint.INDEX)) if e is not None]
    return bool(sizes) and max(sizes) >= index_bytes


def load_plan_apart(source: Source, opts: Options, load: Callable[..., tuple[Checkpoint, Plan]]
                    ) -> tuple[Checkpoint, Plan]:
    """``load(source, opts, banked=True)`` (``pack.load_plan``, passed in: this module imports no stage above it;
    the child imports it by name) run in a spawned child; its errors are raised here as there (a ``ConvertError``:
    one line). The checkpoint's source is this process's ``source``, not the child's copy."""
    ctx = mp.get_context("spawn")  # not fork: torch's warm-up thread runs beside the plan
    try:
        with ProcessPoolExecutor(1, mp_context=ctx, initializer=die_with, initargs=(os.getpid(),)) as pool:
            ckpt, plan = pool.submit(_planned, load, source.for_worker(), opts).result()
    except BrokenProcessPool:
        raise ConvertError(f"{source.name}: the process planning the pack ended without a plan (out of memory?)"
                           ) from None
    ckpt.source = source
    return ckpt, plan


def _planned(load: Callable[..., tuple[Checkpoint, Plan]], source: Source, opts: Options) -> tuple[Checkpoint, Plan]:
    """(In the child.) The banked plan, sent back without the table where its waves are made from the outline
    (``Plan.expansion``): the pack never reads it, and the module-by-module plan reads it again if asked for."""
    ckpt, plan = load(source, opts, banked=True)
    if plan.expansion is not None:
        ckpt.drop_table()
    return ckpt, plan
