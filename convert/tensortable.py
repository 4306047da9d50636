"""A checkpoint's tensors by name, held as columns instead of one Python tuple a tensor.

Why: the pack holds the input's table (every stored tensor's file, dtype, shape and byte range) from the plan to
the finish. The released K3 stores 497,220 tensors; as a dict of ``TensorInfo`` tuples that is about 160 MB of
live objects (the name, the tuple, two large ints and the dict's entry, about 330 bytes a tensor) and, once the
headers' parse has freed its temporaries between them, about 130 MB more of the allocator's holes: 0.29 GB
above the pack's start, held for hours (``benchmarks/RESULTS.md``, issue 43). Here a tensor is its name's UTF-8
bytes in one buffer and about 40 bytes of columns; a ``TensorInfo`` is made when asked for.

``TensorTable`` reads as the dict it replaces (a ``Mapping``, in the order the tensors were added: the files in
order, each header in its order). A lookup hashes the name, bisects the sorted hashes and compares the bytes.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import ItemsView, Iterable, Iterator, Mapping, ValuesView

import numpy as np

from .safetensors_format import TensorInfo


class TensorTable(Mapping[str, TensorInfo]):
    """Tensors by name, added a header at a time (``add``); read only through the ``Mapping`` methods."""

    def __init__(self, infos: Iterable[TensorInfo] = ()) -> None:
        self._names = bytearray()  # every name's UTF-8 bytes, one after the other
        self._ends = array("q")  # where each name ends in _names
        self._start, self._end = array("q"), array("q")  # each tensor's byte range in its file
        self._spec = array("l")  # each tensor's (file, dtype, shape): an index into _specs
        self._specs: list[tuple[str, str, tuple[int, ...]]] = []
        self._spec_of: dict[tuple[str, str, tuple[int, ...]], int] = {}
        self._hash = array("q")  # hash(name), this process's (str hashes are salted per process: not pickled)
        self._sorted: tuple[array, array] | None = None  # the hashes sorted and their rows; made on a lookup
        self.add(infos)

    def add(self, infos: Iterable[TensorInfo]) -> None:
        """Append tensors (a name already in the table is the caller's to refuse: ``checkpoint._stored_tensors``)."""
        names, ends, spec_of = self._names, self._ends, self._spec_of
        for t in infos:
            key = (t.file, t.dtype, t.shape)
            k = spec_of.get(key)
            if k is None:
                k = spec_of[key] = len(self._specs)
                self._specs.append(key)
            names += t.name.encode()
            ends.append(len(names))
            self._start.append(t.start)
            self._end.append(t.end)
            self._spec.append(k)
            self._hash.append(hash(t.name))
        self._sorted = None

    def isdisjoint(self, names: Iterable[str]) -> bool:
        """None of ``names`` is in the table (a header checked against the files before it)."""
        return not self._ends or not any(map(self.__contains__, names))

    # -- the Mapping ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._ends)

    def __iter__(self) -> Iterator[str]:
        names, a = self._names, 0
        for b in self._ends:
            yield names[a:b].decode()
            a = b

    def __getitem__(self, name: str) -> TensorInfo:
        row = self._row(name)
        if row < 0:
            raise KeyError(name)
        return self._info(row, name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._row(name) >= 0

    def items(self) -> ItemsView[str, TensorInfo]:
        return _Items(self)

    def values(self) -> ValuesView[TensorInfo]:
        return _Values(self)

    def _rows(self) -> Iterator[tuple[str, TensorInfo]]:
        names, a = self._names, 0
        for row, b in enumerate(self._ends):
            name = names[a:b].decode()
            a = b
            yield name, self._info(row, name)

    # -- rows -----------------------------------------------------------------------------------

    def _info(self, row: int, name: str) -> TensorInfo:
        file, dtype, shape = self._specs[self._spec[row]]
        return TensorInfo(name, file, dtype, shape, self._start[row], self._end[row])

    def _row(self, name: str) -> int:
        """The row of ``name``, or -1."""
        if self._sorted is None:  # numpy's sort of 500,000 hashes: milliseconds
            h = np.frombuffer(self._hash, np.int64)
            order = np.argsort(h, kind="stable")
            self._sorted = array("q", h[order].tobytes()), array("q", order.astype(np.int64).tobytes())
        hashes, rows = self._sorted
        h, raw = hash(name), None
        i = bisect_left(hashes, h)
        while i < len(hashes) and hashes[i] == h:
            row = rows[i]
            raw = raw if raw is not None else name.encode()
            if self._names[self._ends[row - 1] if row else 0:self._ends[row]] == raw:
                return row
            i += 1
        return -1

    # -- pickling (a worker process, a Ray task): the hashes are this process's, made again there ---------------

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_sorted")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._hash = array("q", map(hash, self))
        self._sorted = None

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} tensors)"


class _Items(ItemsView):
    """``items()`` in one pass over the rows (the default looks each name up again)."""

    def __iter__(self) -> Iterator[tuple[str, TensorInfo]]:
        return self._mapping._rows()


class _Values(ValuesView):
    def __iter__(self) -> Iterator[TensorInfo]:
        return (info for _, info in self._mapping._rows())
