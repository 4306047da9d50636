"""What both engine runners share: the load tracker and the result file.

Runs inside an engine's own python (vLLM's or SGLang's virtual environment), started by
``kimi_convert.enginecheck`` as a script: it must not import ``kimi_convert`` (that environment does
not have it), only the standard library and torch.

The tracker never changes what the engine does; it watches:

* **unfilled**: before loading, every parameter is filled with a sentinel (NaN for 16/32/64-bit
  floats, 0xFF bytes for 8-bit types and all-ones for integers). An element that still holds the
  sentinel afterwards, and that no observed write covered, was never written by the engine's loader.
* **skipped**: every checkpoint tensor the engine's weight iterator offers to ``load_weights`` is
  tainted; a ``TorchDispatchMode`` that only observes (it runs each op unchanged) carries the taint
  through every op (views, casts, ``cat``, ``narrow``...) and records which parameters each write
  (any op whose schema marks an argument as written) lands in. An offered tensor whose data reached
  no parameter was skipped.
* **casts**: a write whose checkpoint tensor had another dtype than the parameter it lands in
  (``reinterpret``: between integer/8-bit and float types, e.g. packed uint8 into bf16; ``narrowing``:
  a float type to one with fewer bits; ``widening``: the opposite). Two kinds are exact and not reported as
  bad (``exact_casts``): ``bitwise``, where the bytes land unchanged (int8 <-> uint8, whose conversion is modulo
  256; or a same-size type the engine views as the parameter's before writing: DeepSeek V4's E8M0 scales viewed
  as uint8, models/deepseek_v4/nvidia/model.py ``load_weights``), and ``exact``, an integer narrowed whose
  offered values all fit the parameter's type (DeepSeek V4's I64 ``tid2eid`` expert ids into int32), or an integer
  made a float whose significand holds every offered value (|v| <= 2^(mantissa bits + 1): compressed-tensors' I64
  ``weight_shape`` into both engines' WNA16 MoE parameter of the model's float dtype, vLLM
  ``CompressedTensorsWNA16MoEMethod.create_weights``, SGLang ``CompressedTensorsWNA16MoE.create_weights``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections import defaultdict

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_WIDE_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: The GPU presented to the engines: Blackwell B200, compute capability 10.0 (sm_100), so they take the
#: code paths a deployment takes.
CAPABILITY = (10, 0)
DEVICE_NAME = "NVIDIA B200"
DEVICE_MEMORY = 192 * 1024**3


def _is_8bit(dt: torch.dtype) -> bool:
    return torch.empty((), dtype=dt).element_size() == 1


def _kind(dt: torch.dtype) -> str:
    """'float' for 16/32/64-bit floats; 'raw' for 8-bit types (uint8/int8/fp8: packed or scale bytes); 'int'."""
    if dt in _WIDE_FLOATS:
        return "float"
    if _is_8bit(dt):
        return "raw"
    return "int"


def _bits(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size() * 8


def cast_class(src: torch.dtype, dst: torch.dtype) -> str | None:
    """None when the dtypes match; else 'reinterpret', 'narrowing' or 'widening'."""
    if src == dst:
        return None
    ks, kd = _kind(src), _kind(dst)
    if ks != kd or ks == "raw":
        return "reinterpret"
    return "narrowing" if _bits(dst) < _bits(src) else "widening"


def fill_sentinel(t: torch.Tensor) -> None:
    with torch.no_grad():
        if t.dtype in _WIDE_FLOATS:
            t.fill_(float("nan"))
        elif _is_8bit(t.dtype) or t.dtype == torch.bool:
            t.view(torch.uint8).fill_(0xFF)
        else:
            t.fill_(-1)


def sentinel_mask(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if t.dtype in _WIDE_FLOATS:
            return torch.isnan(t)
        if _is_8bit(t.dtype) or t.dtype == torch.bool:
            return t.view(torch.uint8) == 0xFF
        return t == -1


def _tensors(obj) -> list[torch.Tensor]:
    flat, _ = tree_flatten(obj)
    return [x for x in flat if isinstance(x, torch.Tensor)]


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a view can touch: [first, last + 1)."""
    es = t.element_size()
    lo = t.storage_offset() * es
    if t.numel() == 0:
        return lo, lo
    return lo, lo + (sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * es


def _key(t: torch.Tensor) -> int | None:
    try:
        if t.device.type == "meta":
            return None
        s = t.untyped_storage()
        return s.data_ptr() if s.nbytes() else None
    except (RuntimeError, NotImplementedError):
        return None


def _part(t: torch.Tensor, lo: int, hi: int, sp: tuple
          ) -> tuple[int | None, tuple[int, int, int] | None, int | None]:
    """What a read of ``t`` (bytes [lo, hi) of its storage) takes of the checkpoint tensor at span ``sp``: the
    byte offset read in that tensor (None where derived from all of it); where the read holds more than the
    tensor (a ``cat`` of several), the rows of ``t`` that hold it (first, end, rows of ``t``; None: all); and the
    bytes from one row of the read to the next in the tensor (``_row_step``)."""
    a, b = max(lo, sp[0]), min(hi, sp[1])
    origin = None if sp[2] is None else sp[2] + a - sp[0]
    step = None if origin is None else _row_step(t)
    if (a, b) == (lo, hi) or not t.dim() or not t.is_contiguous() or not t.shape[0]:
        return origin, None, step
    row = (hi - lo) // t.shape[0]
    if not row or (a - lo) % row or (b - lo) % row:
        return origin, None, step
    return origin, ((a - lo) // row, (b - lo) // row, t.shape[0]), step


def _row_step(t: torch.Tensor) -> int | None:
    """Bytes from one row (the next-to-last dimension) of read ``t`` to the next in its storage: a stored row's
    bytes where it reads rows as stored; twice that where it takes every other row (vLLM 0.33's Inkling loader
    de-interleaving a ``w13`` bank stored [g0, u0, g1, u1, ...]: ``[0::2]`` / ``[1::2]``); anything else where it
    does not read rows (a transposed view). None for a read of fewer than two rows (no step to tell)."""
    if t.dim() < 2 or t.shape[-2] < 2:
        return None
    return t.stride(-2) * t.element_size()


def _rows_of(w: torch.Tensor, rows: tuple[int, int, int] | None) -> torch.Tensor:
    """The rows of write ``w`` that received ``rows`` of the read (``_part``); all of ``w`` where the write does
    not have the read's rows (then the write as a whole is recorded, as for a derived tensor)."""
    if rows is None or not w.dim() or w.shape[0] != rows[2]:
        return w
    return w.narrow(0, rows[0], rows[1] - rows[0])


class _Observe(TorchDispatchMode):
    """Runs every op unchanged; carries checkpoint taint and records writes into parameter storages."""

    def __init__(self, tracker: Tracker):
        super().__init__()
        self.tr = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self.tr._observe(func, args, kwargs, out)
        except Exception as e:  # an observer bug must not look like an engine failure
            self.tr.observer_errors.append(f"{func}: {type(e).__name__}: {e}")
        return out


class Tracker:
    def __init__(self) -> None:
        # storage -> {checkpoint tensor: (dtype, span or None for all of it)}: the engine's iterator may offer
        # many tensors as views of one memory-mapped file, and a dim-0 ``cat`` holds each input in its own
        # rows. A span is (first byte, last byte + 1, the checkpoint tensor's byte at the first or None where
        # the bytes are derived from all of it)
        self.taint: dict[int, dict[str, tuple[torch.dtype, tuple[int, int, int | None] | None]]] = {}
        self._refs: list[torch.Tensor] = []  # keep tainted storages alive so addresses are not reused
        self.offered: dict[str, dict] = {}
        self.offered_order: list[str] = []
        self.current: str | None = None  # the tensor load_weights is working on (the last one offered)
        # the last Python number read out of checkpoint data (``.item()``) and whose it was: a loader that writes
        # a one-element parameter with ``fill_(w.item())`` (SGLang's default_weight_loader) writes that data
        self._scalar: tuple[object, dict[str, torch.dtype]] | None = None
        self.stored: dict[str, set[str]] = defaultdict(set)
        self.casts: dict[tuple[str, str], tuple[str, str, str]] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        # the buffers the engine's own loader fills from the checkpoint by name (``arm``'s ``loadable``): a write of
        # checkpoint data into one stores that tensor, as into a parameter; they are not required to be filled
        self.loadable: dict[str, torch.Tensor] = {}
        self.pstore: dict[int, list[str]] = defaultdict(list)  # storage -> parameter (and loadable buffer) names
        self.written: dict[int, torch.Tensor] = {}  # storage -> byte mask of written bytes
        self.observer_errors: list[str] = []
        self.shared_storage_offers: list[str] = []
        # (checkpoint tensor, parameter) -> [(element offset in the parameter, shape, stride, byte offset read
        # in the checkpoint tensor or None, bytes from one row read to the next or None)] of each write
        self.spans: dict[tuple[str, str], list[tuple[int, tuple, tuple, int | None, int | None]]] = defaultdict(list)
        # the value of each one-element checkpoint tensor (a global or input scale): an engine rule that keeps one
        # of two such tensors holds only where they are equal (``result``'s ``drop_rule``)
        self.scalars: dict[str, float] = {}
        # (min, max) of each integer checkpoint tensor: an integer narrowed is exact where they fit (``_exact``)
        self.int_range: dict[str, tuple[int, int]] = {}

    # -- before loading --------------------------------------------------------------------------
    def arm(self, model: torch.nn.Module, loadable: set[str] | None = None) -> None:
        """Fill every parameter and buffer with the sentinel and index the storages a checkpoint tensor may be
        stored in: the parameters', and those of the buffers named in ``loadable`` (the ones the engine's own
        loader fills by name: each runner's ``loadable_buffers``). A write into any other buffer stores nothing."""
        for name, p in model.named_parameters():  # a parameter reachable under two names is reported once
            self.params[name] = p
        for name, b in model.named_buffers():
            self.buffers[name] = b
        self.loadable = {n: b for n, b in self.buffers.items() if n in (loadable or ()) and n not in self.params}
        for t in list(self.params.values()) + list(self.buffers.values()):
            if t.numel() and t.device.type != "meta":
                fill_sentinel(t.data)
        for name, p in {**self.params, **self.loadable}.items():
            k = _key(p)
            if k is None:
                continue
            self.pstore[k].append(name)
            if k not in self.written:
                self.written[k] = torch.zeros(p.untyped_storage().nbytes(), dtype=torch.bool)

    def weights(self, it):
        """Wrap the engine's weight iterator: taint what it offers, pass it on unchanged."""
        seen: dict[int, str] = {}
        for item in it:
            name, t = item[0], item[1]
            self.current = name
            self.offered_order.append(name)
            self.offered[name] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}
            k = _key(t)
            if k is not None:
                if k in seen:
                    self.shared_storage_offers.append(f"{name} shares storage with {seen[k]}")
                seen[k] = name
                self.taint.setdefault(k, {})[name] = (t.dtype, (*_span(t), 0))
                self._refs.append(t)
            if t.numel() == 1 and t.device.type != "meta":
                self.scalars[name] = float(t.float().reshape(()))
            if t.numel() and t.device.type != "meta" and not t.dtype.is_floating_point and t.dtype != torch.bool:
                self.int_range[name] = (int(t.min()), int(t.max()))
            yield item

    def mode(self) -> _Observe:
        return _Observe(self)

    # -- during loading --------------------------------------------------------------------------
    def _observe(self, func, args, kwargs, out) -> None:
        ins = _tensors((args, kwargs))
        names: dict[str, torch.dtype] = {}
        # names whose data reaches this op from outside any parameter -> ``_part``: (byte offset read in the
        # offered tensor or None through a derived tensor, the rows of the read that hold it or None for all, the
        # bytes from one row read to the next)
        direct: dict[str, tuple[int | None, tuple[int, int, int] | None, int | None]] = {}
        for t in ins:
            k = _key(t)
            if k is not None and k in self.taint:
                lo, hi = _span(t)
                for n, (dt, sp) in self.taint[k].items():
                    if sp is None or (sp[0] < hi and lo < sp[1]):
                        names[n] = dt
                        if k not in self.pstore:
                            direct[n] = (None, None, None) if sp is None else _part(t, lo, hi, sp)
        if func is torch.ops.aten._local_scalar_dense.default and names:
            self._scalar = (out, dict(names))
        elif not names and self._scalar is not None and func is torch.ops.aten.fill_.Scalar \
                and len(args) > 1 and args[1] == self._scalar[0]:
            names = dict(self._scalar[1])  # fill_(w.item()): the checkpoint tensor's value written
        written: list[torch.Tensor] = []
        schema = func._schema
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            written += _tensors(v)
        for w in written:
            k = _key(w)
            if k is None:
                continue
            if k in self.pstore:
                self._mark(w, k)
                for pname in self._landed(w, k):
                    dest = self.params.get(pname)
                    dest = self.loadable[pname] if dest is None else dest
                    pdt = dest.dtype
                    for n, sdt in names.items():
                        self.stored[n].add(pname)
                        if n in direct:
                            part = _rows_of(w, direct[n][1]) if len(written) == 1 else w
                            rel = part.storage_offset() - dest.storage_offset()
                            self.spans[(n, pname)].append((rel, tuple(part.shape), tuple(part.stride()),
                                                           direct[n][0], direct[n][2]))
                        c = self._exact(n, sdt, pdt, cast_class(sdt, pdt), ins)
                        if c:
                            self.casts[(n, pname)] = (c, str(sdt).replace("torch.", ""),
                                                      str(pdt).replace("torch.", ""))
        if names:
            self._taint_cat(func, args, kwargs, out)
            for t in _tensors(out) + written:
                k = _key(t)
                if k is None or (k in self.taint and k not in self.pstore and any(
                        sp is not None for _, sp in self.taint[k].values())):
                    continue  # a view of offered tensors: their byte spans already say which it holds
                self._taint_write(t, k, names)
                if k not in self.pstore:
                    self._refs.append(t)

    def _taint_write(self, t: torch.Tensor, k: int, names: dict[str, torch.dtype]) -> None:
        """Mark ``t``'s storage as holding ``names``' data, as a derived tensor (all of it). In a storage several
        parameters share (``_landed``) only the bytes written: a later read of another parameter of it (the
        next write into it reads its destination) does not carry them."""
        shared = k in self.pstore and len(self.pstore[k]) > 1 and t.numel()
        lo, hi = _span(t) if shared else (0, 0)
        held = self.taint.setdefault(k, {})
        for n, dt in names.items():
            old = held.get(n, (dt, (lo, hi, None)))[1]
            span = None if not shared or old is None else (min(lo, old[0]), max(hi, old[1]), None)
            held[n] = (dt, span)

    def _landed(self, w: torch.Tensor, k: int) -> list[str]:
        """The parameters (and loadable buffers) of storage ``k`` that write ``w`` touches. Where several share one
        storage (SGLang's afmoe.py ``AfmoeMoE.pack_params`` flattens every expert's weight into one buffer and
        makes each parameter a view of it), only those whose bytes the write overlaps: a write into expert 1's
        parameter is not one into expert 0's."""
        names = self.pstore[k]
        if len(names) == 1 or not w.numel():
            return names
        lo, hi = _span(w)
        out = []
        for pname in names:
            dest = self.params.get(pname)
            plo, phi = _span(self.loadable[pname] if dest is None else dest)
            if plo < hi and lo < phi:
                out.append(pname)
        return out

    def _exact(self, name: str, src: torch.dtype, dst: torch.dtype, cls: str | None, ins) -> str | None:
        """``cast_class``, with the exact kinds told apart (module docstring): ``bitwise`` and ``exact``."""
        ints = (torch.int8, torch.uint8)
        if cls == "reinterpret" and src.is_floating_point and src.itemsize == 1 \
                and dst in (torch.bfloat16, torch.float32, torch.float64):
            return "widening"  # every FP8 / E8M0 value is exact there (SGLang's FP8 weight_scale_inv is F32)
        if cls == "reinterpret" and src.itemsize == dst.itemsize:
            if src in ints and dst in ints:
                return "bitwise"
            if any(t.dtype == dst and name in self.taint.get(_key(t), {}) for t in ins):
                return "bitwise"  # the engine viewed the bytes as the parameter's type before the write
        if cls == "reinterpret" and _kind(src) == "int" and dst.is_floating_point and name in self.int_range:
            lo, hi = self.int_range[name]
            if max(-lo, hi) <= 2 / torch.finfo(dst).eps:  # 2^(mantissa bits + 1)
                return "exact"
        if cls == "narrowing" and _kind(src) == _kind(dst) == "int" and name in self.int_range:
            lo, hi = self.int_range[name]
            info = torch.iinfo(dst)
            if info.min <= lo and hi <= info.max:
                return "exact"
        return cls

    def _taint_cat(self, func, args, kwargs, out) -> None:
        """A dim-0 ``aten.cat`` of checkpoint data (SGLang's DeepSeek loader cats q_a_proj and
        kv_a_proj_with_mqa before one write into fused_qkv_a_proj_with_mqa): its output is tainted with each
        input's own span, so that a later write of it says which of its rows came from which tensor. Any other
        op, or a cat this cannot lay out, taints its outputs as one derived tensor (``_observe``)."""
        if func is not torch.ops.aten.cat.default:
            return
        members = self._cat_members(args[0] if args else kwargs.get("tensors", ()),
                                    args[1] if len(args) > 1 else kwargs.get("dim", 0), out)
        k = _key(out) if members else None
        if k is not None and k not in self.pstore:
            self.taint[k] = members
            self._refs.append(out)

    def _cat_members(self, tensors, dim: int, out) -> dict | None:
        """{name: (dtype, span in ``out``'s storage)} of a cat along dim 0 into a contiguous ``out`` of the inputs'
        dtype, from inputs that are offered tensors (or views of them) or derived ones; None otherwise (a
        parameter read, an input twice, a dtype promoted, a strided input)."""
        if not isinstance(out, torch.Tensor) or not out.dim() or dim % out.dim() or not out.is_contiguous():
            return None
        members: dict = {}
        at = out.storage_offset() * out.element_size()
        for t in tensors:
            if t.numel() == 0:  # cat skips a legacy empty 1-d input
                continue
            k = _key(t)
            if t.dtype != out.dtype or not t.is_contiguous() or k in self.pstore:
                return None
            lo, hi = _span(t)
            for n, (dt, sp) in self.taint.get(k, {}).items():
                if n in members:
                    return None
                if sp is None:
                    members[n] = (dt, (at, at + hi - lo, None))
                elif sp[0] < hi and lo < sp[1]:
                    a, b = max(lo, sp[0]), min(hi, sp[1])
                    members[n] = (dt, (at + a - lo, at + b - lo, None if sp[2] is None else sp[2] + a - sp[0]))
            at += hi - lo
        return members

    def _mark(self, w: torch.Tensor, k: int) -> None:
        mask = self.written[k]
        es = w.element_size()
        base = w.storage_offset() * es
        if w.numel() == 0:
            return
        if w.is_contiguous():
            mask[base: base + w.numel() * es] = True
            return
        view = mask.as_strided([*list(w.shape), es], [s * es for s in w.stride()] + [1], base)
        view.fill_(True)

    # -- after loading ---------------------------------------------------------------------------
    def _unwritten(self, name: str, p: torch.Tensor) -> int:
        """Elements of parameter ``name`` that still hold the sentinel and no observed write covered."""
        if p.numel() == 0 or p.device.type == "meta":
            return 0
        sent = sentinel_mask(p.data)
        k = _key(p)
        if k in self.written:
            es = p.element_size()
            m = self.written[k]
            if p.untyped_storage().nbytes() == m.numel():
                wv = m.as_strided([*list(p.shape), es], [s * es for s in p.stride()] + [1],
                                  p.storage_offset() * es)
                sent = sent & ~wv.all(-1)
        return int(sent.sum())

    def result(self, model: torch.nn.Module, optional: list[tuple], mtp_rule=None, drop_rule=None,
               main_rule=None, target: list[tuple] | None = None) -> dict:
        """``optional``: (regex, why) or (regex, why, count) naming parameters the engine legitimately
        leaves unwritten (with a count: exactly that many elements, e.g. a module's padding rows).
        ``mtp_rule(name)``: why the engine's main model drops a checkpoint tensor of an MTP layer on purpose
        (the engine's own rule; its MTP model loads it), or None: such a skipped tensor is listed as
        ``mtp_skipped``, not ``skipped``. ``drop_rule(name)``: (why, holds) where the engine drops a checkpoint
        tensor by its own rule that is right only on a condition (SGLang keeps one of two equal scales), or
        None: one that holds is listed as ``rule_dropped``, one that does not as ``rule_broken`` (a failure).
        A speculative-decoding draft's check: ``main_rule(name)``, why the draft drops a checkpoint tensor of the main
        model on purpose (listed as ``main_skipped``), and ``target``, (regex, why, the target's module) naming the
        draft's parameters the engine replaces with the target model's after loading (``from_target`` where
        unwritten)."""
        import re

        targ = [(re.compile(t[0]), {"why": t[1], "target": t[2]}) for t in target or []]
        now = dict(model.named_parameters())
        unfilled, allowed, from_target = self._unfilled(now, optional, targ)
        skipped, mtp, main, ruled = self._skipped(mtp_rule, main_rule, drop_rule)
        casts = [{"tensor": n, "param": p, "class": c, "from": a, "to": b}
                 for (n, p), (c, a, b) in sorted(self.casts.items())]
        return {
            "params": len(self.params),
            "offered": len(self.offered),
            "unfilled": unfilled,
            "allowed_unfilled": allowed,
            "skipped": [{"tensor": n, **self.offered[n]} for n in skipped],
            "mtp_skipped": [{"tensor": n, **self.offered[n], "why": why} for n, why in mtp.items()],
            "main_skipped": [{"tensor": n, **self.offered[n], "why": why} for n, why in main.items()],
            "from_target": from_target,
            # every parameter the engine replaces with the target model's after loading, written by the draft or not
            "target_params": sorted(n for n in self.params if any(rx.search(n) for rx, _ in targ)),
            "rule_dropped": [{"tensor": n, **self.offered[n], "why": why} for n, (why, ok) in ruled.items() if ok],
            "rule_broken": [{"tensor": n, **self.offered[n], "why": why} for n, (why, ok) in ruled.items() if not ok],
            # widening loses nothing; reinterpretations (the worst) first
            "bad_casts": sorted((c for c in casts if c["class"] in ("reinterpret", "narrowing")),
                                key=lambda c: c["class"] != "reinterpret"),
            "widening_casts": [c for c in casts if c["class"] == "widening"],
            "exact_casts": [c for c in casts if c["class"] in ("bitwise", "exact")],
            "created_during_load": sorted(set(now) - set(self.params)),
            "buffers_never_written": self._buffers_unfilled(model),
            # the buffers the engine's loader filled from the checkpoint (``arm``'s ``loadable``): where each tensor
            # went is in ``stored``
            "loaded_buffers": sorted({p for ps in self.stored.values() for p in ps if p in self.loadable}),
            "stored": {n: sorted(self.stored.get(n, ())) for n in self.offered_order},
            "observer_errors": self.observer_errors[:20],
            "shared_storage_offers": self.shared_storage_offers[:20],
        }

    def _unfilled(self, now: dict[str, torch.Tensor], optional: list[tuple], targ: list[tuple]
                  ) -> tuple[list[dict], list[dict], list[dict]]:
        """The parameters left (partly) unwritten, in three lists: unexplained (a failure), allowed by the engine's
        ``optional`` rule, and replaced with the target model's after loading (a draft's). ``now``: the
        parameters after loading by name (an engine may replace a parameter object while it processes)."""
        import re

        opt = [(re.compile(o[0]), o[1], o[2] if len(o) > 2 else None) for o in optional]
        unfilled, allowed, from_target = [], [], []
        for name, p in self.params.items():
            cur = now.get(name, p)
            n = self._unwritten(name, cur)
            if not n:
                continue
            entry = {"param": name, "dtype": str(cur.dtype).replace("torch.", ""), "shape": list(cur.shape),
                     "unfilled": n, "numel": cur.numel()}
            why = next((w for rx, w, count in opt if rx.search(name) and count in (None, n)), None)
            shared = next((w for rx, w in targ if rx.search(name)), None)
            if shared:
                from_target.append({**entry, **shared})
            elif why:
                allowed.append({**entry, "why": why})
            else:
                unfilled.append(entry)
        return unfilled, allowed, from_target

    def _buffers_unfilled(self, model: torch.nn.Module) -> list[str]:
        """The buffers still wholly the sentinel after loading: never written."""
        out = []
        nowb = dict(model.named_buffers())
        for name, b in self.buffers.items():
            cur = nowb.get(name, b)
            if cur.numel() and cur.device.type != "meta" and bool(sentinel_mask(cur.data).all()):
                out.append(name)
        return out

    def _skipped(self, mtp_rule, main_rule, drop_rule) -> tuple[list[str], dict, dict, dict]:
        """The offered tensors stored nowhere, less those an engine's own rule drops on purpose, and those three
        rules' tensors apart (MTP layer, main model, conditional drop: each rule's tensors left out of the next),
        so a failure lists only the unexplained."""
        skipped = [n for n in self.offered_order if not self.stored.get(n)]
        mtp = {n: why for n in skipped if mtp_rule is not None and (why := mtp_rule(n))}
        skipped = [n for n in skipped if n not in mtp]
        main = {n: why for n in skipped if main_rule is not None and (why := main_rule(n))}
        skipped = [n for n in skipped if n not in main]
        ruled = {n: r for n in skipped if drop_rule is not None and (r := drop_rule(n))}
        skipped = [n for n in skipped if n not in ruled]
        return skipped, mtp, main, ruled



# -- GPU-specific pieces, shared by the runners' patch lists -----------------------------------------


def persistent_buffers(model: torch.nn.Module) -> set[str]:
    """The names of ``model``'s persistent buffers (those ``state_dict`` holds): a buffer is non-persistent where its
    module lists it in ``_non_persistent_buffers_set`` (``register_buffer(..., persistent=False)``)."""
    out = set()
    for mname, m in model.named_modules(remove_duplicate=False):
        skip = getattr(m, "_non_persistent_buffers_set", set())
        out.update(f"{mname}.{b}" if mname else b for b, _ in m.named_buffers(recurse=False) if b not in skip)
    return out


class Inert:
    """A CUDA stream or event that does nothing (nothing runs on a device here)."""

    def __init__(self, *a, **k):
        self.device = torch.device("cpu")
        self.cuda_stream = 0

    def __getattr__(self, name):
        return lambda *a, **k: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cpu(dev):
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return torch.device("cpu")
    if isinstance(dev, str) and dev.startswith("cuda"):
        return "cpu"
    if isinstance(dev, int) and not isinstance(dev, bool):
        return "cpu"
    return dev


def is_mimo_v2(config) -> bool:
    """A MiMo-V2 model (its MTP layers are ``model.mtp.layers.{i}``, which both engines' main models skip by the name
    holding "mtp": vLLM 0.33 / SGLang 0.5.23 ``mimo_v2.py``), by its model type or architecture."""
    archs = getattr(config, "architectures", None) or []
    return getattr(config, "model_type", None) in ("mimo_v2_flash", "mimo_v2", "mimo_v2_mtp") or any(
        a.startswith("MiMoV2") for a in archs)


def config_json(model_dir: str) -> dict | None:
    """The checkpoint's ``config.json`` as stored (not the engine's reading of it); None where the folder has none
    readable as a JSON object (Mistral's own layout: the engine adapts params.json)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def registered(model_dir: str, supported) -> bool | None:
    """Whether the engine's registry (``supported``: its ``ModelRegistry.get_supported_archs()``) names one of the
    checkpoint's ``config.json`` architectures; None without a config.json (``config_json``). A derivation leaves out
    an engine that serves none of them."""
    config = config_json(model_dir)
    if config is None:
        return None
    return any(a in supported for a in config.get("architectures") or [])


def is_inkling(config) -> bool:
    """An Inkling model (Thinking Machines: ``inkling_mm_model``, vLLM's text-only ``inkling_model``), whose MTP head is
    ``model.mtp.layers.{d}.*``: vLLM 0.33's main model maps ``model.mtp.`` to None (``models/inkling/nvidia/model.py``
    ``_load_inkling_weights``), SGLang 0.5.23's has no parameter for it (``srt/models/inkling.py``
    ``InklingForConditionalGeneration.load_weights`` passes a name without one); each engine's draft loads it."""
    archs = getattr(config, "architectures", None) or []
    return getattr(config, "model_type", None) in ("inkling_mm_model", "inkling_model") or any(
        a.startswith("Inkling") for a in archs)


class CpuDevices(TorchFunctionMode):
    """Moves explicit CUDA allocations and transfers to the CPU; values, dtypes and shapes are unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if kwargs.get("pin_memory"):  # a pinned host buffer (FlashInfer's prefill workspace) needs a driver
            kwargs["pin_memory"] = False
        name = getattr(func, "__name__", "")
        if name == "cuda" and args:
            return args[0]
        if name == "to" and len(args) > 1:
            args = (args[0], _cpu(args[1]), *args[2:])
        if name == "pin_memory" and args:
            return args[0]
        return func(*args, **kwargs)


def patch_torch_cuda(capability: tuple[int, int], name: str, memory: int, available: bool):
    """torch.cuda's device queries answer for one presented GPU; streams and events are inert."""
    import torch.cuda

    props = type("Props", (), {"name": name, "major": capability[0], "minor": capability[1],
                               "total_memory": memory, "multi_processor_count": 148,
                               "L2_cache_size": 126 * 1024**2, "warp_size": 32, "gcnArchName": "",
                               "max_shared_memory_per_block_optin": 232448,
                               "uuid": "GPU-00000000-0000-0000-0000-000000000000"})()
    torch.cuda.Stream = Inert
    torch.cuda.Event = Inert
    torch.cuda.ExternalStream = Inert
    torch.cuda.current_stream = lambda *a, **k: Inert()
    torch.cuda.default_stream = lambda *a, **k: Inert()
    torch.cuda.stream = lambda *a, **k: Inert()
    torch.cuda.current_device = lambda: 0
    if hasattr(torch, "accelerator"):  # the device-generic queries answer for the same GPU (vLLM 0.33's Step 5
        torch.accelerator.current_device_index = lambda: 0  # sparse attention asks current_device_index)
        torch.accelerator.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda *a, **k: capability
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_name = lambda *a, **k: name
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.mem_get_info = lambda *a, **k: (memory, memory)
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.memory_reserved = lambda *a, **k: 0
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    if available:
        torch.cuda.is_available = lambda: True
    return props


def import_all(modules: list[str]) -> None:
    """Import each module a check will import (the fork server's preload); one this engine version lacks, or
    that fails, is left to the check, which imports it itself and reports what goes wrong."""
    import importlib

    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception:
            continue


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exception_info(e: BaseException) -> dict:
    """Type, message and the last frames of the engine's code (torch internals and this runner left out)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "/torch/" not in f.filename and not f.filename.endswith("runner_common.py")]
    frames = frames[-6:] or traceback.extract_tb(e.__traceback__)[-6:]
    return {
        "type": type(e).__name__,
        "message": str(e)[:4000],
        "frames": [f"{f.filename}:{f.lineno} in {f.name}: {f.line}" for f in frames],
    }


def main(engine: str, run) -> None:
    """``run(model_dir, result)`` fills ``result``; this writes it as JSON to ``--out`` (or stdout)."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--out", help="write the JSON result here (default: stdout)")
    ap.add_argument("--numerics", help="also read every layer as the engine's GEMM does, into this folder")
    ap.add_argument("--derive", choices=("trace", "build"),
                    help="mapping derivation: 'trace' offers --weights' zeros and reports where each lands and every "
                         "module as built; 'build' only builds the model and reports its modules")
    ap.add_argument("--draft", action="store_true",
                    help="build and load the engine's speculative-decoding draft model (MTP / NextN) for the "
                         "checkpoint instead of its main model")
    ap.add_argument("--weights", help="with --derive trace: a JSON list of [name, shape, dtype] offered instead of "
                                      "the checkpoint's files")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="read the config through the checkpoint's own config code (auto_map), as the engines' own "
                         "--trust-remote-code does")
    a = ap.parse_args()
    t0 = time.perf_counter()
    result: dict = {"engine": engine, "model_dir": os.path.abspath(a.model_dir), "error": None,
                    "phase": "start", "patches": [], "timings": {}, "numerics_dir": a.numerics,
                    "derive": a.derive, "weights_spec": a.weights, "draft": a.draft, "role": "draft" if a.draft
                    else "main", "trust_remote_code": a.trust_remote_code}
    try:
        run(os.path.abspath(a.model_dir), result)
    except BaseException as e:  # the engine's own exception is the result, not a crash of the runner
        result["error"] = exception_info(e)
        if isinstance(e, KeyboardInterrupt):
            raise
    result["timings"]["total_s"] = round(time.perf_counter() - t0, 2)
    text = json.dumps(result, indent=1, default=str)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text + "\n")


def numerics(engine: str, result: dict, model, tracker, error: BaseException | None) -> None:
    """With ``--numerics DIR``: every layer read as the engine's GEMM reads it (``runner_numerics``); a draft's layers
    the engine replaces with the target model's (``target_params``) are not read: the main model's check reads them."""
    folder = result.get("numerics_dir")
    if not folder or error is not None:
        return
    import runner_numerics

    t = time.perf_counter()
    try:
        result["numerics"] = runner_numerics.dump(engine, model, tracker, folder, set(result.get("target_params", ())))
    except Exception as e:  # reported, never mistaken for a passing check
        result["numerics"] = {"error": exception_info(e)}
    result["timings"]["numerics_s"] = round(time.perf_counter() - t, 2)


def finish(result: dict, error: BaseException | None, tracker) -> None:
    """The run's last phase: done, or the load's exception with the checkpoint tensor being loaded."""
    result["phase"] = "done"
    if error is not None:
        result["error"] = exception_info(error)
        result["error"]["tensor"] = tracker.current
        result["phase"] = "load-failed"


# -- mapping derivation (kimi-convert mapping derive) -------------------------------------------------


def spec_weights(path: str):
    """The weights a derivation offers instead of a checkpoint's files: zeros of each ``[name, shape, dtype]``
    in the JSON list at ``path``, in its order (only names and shapes matter to where a loader puts them)."""
    with open(path) as f:
        spec = json.load(f)
    for name, shape, dtype in spec:
        yield name, torch.zeros(shape, dtype=getattr(torch, dtype))


_KINDS = (("FusedMoE", "moe"), ("LinearBase", "linear"), ("VocabParallelEmbedding", "embedding"))


def _source_file(cls) -> str:
    import inspect

    try:
        path = inspect.getsourcefile(cls) or ""
    except TypeError:
        return ""
    return path.split("site-packages/", 1)[-1]


def watch_prefixes(quant_config) -> dict[int, str]:
    """The prefix each layer asks its quant method with (``quant_config.get_quant_method(layer, prefix)``, both
    engines): the name an exclude list must select, which is not always the module's attribute path (vLLM's
    Glm4MoeMTP builds its MTP block under ``model.layers.N``, not ``model.layers.N.mtp_block``). Observation only:
    the instance's own method is called unchanged; returns {id(layer): prefix}, filled while the model is built."""
    seen: dict[int, str] = {}
    if quant_config is None:
        return seen
    inner = quant_config.get_quant_method

    def get_quant_method(layer, prefix="", *a, **k):
        seen[id(layer)] = prefix
        return inner(layer, prefix, *a, **k)

    quant_config.get_quant_method = get_quant_method
    return seen


def describe(model: torch.nn.Module, prefixes: dict[int, str] | None = None) -> dict:
    """Every module that holds parameters or a quant method, as the engine built it: its class and file, its
    kind (``moe`` / ``linear`` / ``embedding`` / ``other``, by the engine's own base classes), its quant method's
    class, its direct parameters with shapes, the class and file of the module that built it (its parent) and,
    with ``prefixes`` (``watch_prefixes``), the prefix it asked its quant method with."""
    prefixes = prefixes or {}
    mods = dict(model.named_modules())
    out = {}
    for name, m in mods.items():
        direct = {n: list(p.shape) for n, p in m.named_parameters(recurse=False)}
        qm = getattr(m, "quant_method", None)
        if not direct and qm is None:
            continue
        mro = {c.__name__ for c in type(m).__mro__}
        kind = next((k for base, k in _KINDS if base in mro), "other")
        if kind == "other" and any(n.startswith(("w13_", "w2_")) for n in direct):
            kind = "moe"  # an expert bank by its parameters (vLLM 0.33's RoutedExperts is no FusedMoE subclass)
        parent = mods.get(name.rpartition(".")[0]) if "." in name else model
        out[name] = {"class": type(m).__qualname__, "file": _source_file(type(m)), "kind": kind,
                     "quant_method": type(qm).__name__ if qm is not None else None, "params": direct,
                     "parent_class": type(parent).__qualname__, "parent_file": _source_file(type(parent))}
        if id(m) in prefixes:
            out[name]["quant_prefix"] = prefixes[id(m)]
    return out


def spans(tracker: Tracker) -> list[dict]:
    """Where each offered tensor landed: per (tensor, parameter), the index of the first element written (over
    the parameter's shape), the shape written there, and how many writes; from the observer's own record."""
    out = []
    for (tensor, pname), writes in sorted(tracker.spans.items()):
        p = tracker.params.get(pname)
        if p is None or not writes:
            continue
        rel, shape, *_ = min(writes, key=lambda w: w[0])
        at, rest = [], rel
        for st in p.stride():
            at.append(rest // st if st else 0)
            rest = rest % st if st else rest
        out.append({"tensor": tensor, "param": pname, "param_shape": list(p.shape), "at": at, "shape": list(shape),
                    "writes": len(writes)})
    return out
