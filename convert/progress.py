"""The progress bar of ``pack`` and ``verify-manifest``: bytes in the summary line's units (decimal
MB/GB, as ``pack`` prints its totals), created only when there is work to show (a command that fails
at its first check prints no empty bar), and no time estimate until there is enough to estimate
from (at the start tqdm's rate is a handful of bytes per second and its ETA reads "57781:16:02")."""

from __future__ import annotations

from tqdm import tqdm

#: Fraction of the total done before an ETA is shown.
ETA_AFTER = 0.03
_NO_ETA = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B [{elapsed}, {rate_fmt}]"
_ETA = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]"


class Progress:
    """A lazy tqdm over bytes: ``grow(n)`` adds to the total, ``update(n)`` to what is done."""

    def __init__(self, desc: str, enabled: bool = True, total: int = 0, initial: int = 0):
        self.desc, self.enabled, self.total, self.done = desc, enabled, total, initial
        self._bar: tqdm | None = None
        self._eta = False

    def _shown(self) -> tqdm | None:
        if self._bar is None and self.enabled and self.total > 0:
            self._bar = tqdm(total=self.total, initial=self.done, unit="B", unit_scale=True, unit_divisor=1000,
                             desc=self.desc, dynamic_ncols=True, bar_format=_NO_ETA, smoothing=0.1)
        return self._bar

    def grow(self, n: int) -> None:
        self.total += n
        bar = self._shown()
        if bar is not None:
            bar.total = self.total
            bar.refresh()

    def update(self, n: int) -> None:
        bar = self._shown()  # made (at what was done before) ahead of counting n, which it then adds
        self.done += n
        if bar is None:
            return
        if not self._eta and self.done >= ETA_AFTER * self.total:
            self._eta = True
            bar.bar_format = _ETA  # (a tqdm disabled by TQDM_DISABLE takes the attribute and ignores it)
        bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def human_bytes(n: int) -> str:
    """``n`` bytes in the largest decimal unit that leaves at least 1 of it (``512 B``, ``3.41 MB``, ``1.20 TB``):
    a fixed unit shows a small output and a nearly full disk both as 0.00 GB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
