"""The source-encoding interface: how a checkpoint stores one logical weight, and how to get it back.

A source encoding owns, in one module, everything that depends on how a weight is stored: which stored
tensors form one logical tensor (discovery), what it refuses (missing or mis-shaped parts, a config it
cannot read, values it cannot decode) and how it decodes (calling the numeric kernels in ``kernels/``).
The planner (``plan.discover``), the compute stage (``compute.decode``), ``check_convertible`` and the
numeric check reach an encoding only through ``encodings`` (the registry), so a new way of storing a
weight is one new module there.

This module is below ``plan/`` (``plan.model`` re-exports ``Encoding`` and ``SourceTensor`` from here), and
imports no torch at module level: planning stays torch-free.

**One stored tensor -> several logical weights** (gpt-oss's ``experts.gate_up_proj_blocks``
``[E, 2I, K/32, 16]`` with ``_scales`` ``[E, 2I, K/32]`` and ``gate_up_proj_bias`` ``[E, 2I]``: gate rows
at even, up rows at odd indices: ``gpt_oss_mxfp4``): one call of :meth:`SourceEncoding.claim`, anchored on
the stored tensor, returns one :class:`Claim` per logical weight, each naming its own module and suffix
(``experts.3.gate_proj`` / ``weight``, and ``bias`` claims for the biases, dense values). Each claim's
:class:`SourceTensor` says which part of the stored tensors it is:

- an index or a contiguous range along dim 0 (one expert of a 3-D bank, the first half of a ``[gate; up]``
  stack) is a byte range of the stored tensor: :func:`narrow` makes the part, so each logical weight reads
  only its own bytes;
- anything else (de-interleaving rows: ``Slice(dim=0, start=0, step=2)`` for gate, ``start=1`` for up; a
  split along another dim) is ``SourceTensor.view``: slices that ``encodings.decode`` applies to every part
  (codes, scales, bias alike) before the encoding decodes them, so MXFP4 rows stay with their scales.

``SourceTensor.shape`` is then the logical (sliced) shape. The plan and the pipeline take every
``SourceTensor`` as its parts, keyed by part name: :func:`narrow` names its part ``NAME[i]`` so that the
parts of one stored tensor stay apart, and two sources with the same parts (gate and up of one expert)
are told apart by their logical names and views (the manifest records the view). gpt-oss's encoding is
``gpt_oss_mxfp4``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from ..errors import ConvertError
from ..safetensors_format import DTYPES, TensorInfo

if TYPE_CHECKING:
    import torch


class Encoding(StrEnum):
    """The built-in encodings' names (``SourceTensor.encoding``, the manifest's ``encoding``). A new
    encoding's name may be a plain string: no line here is needed."""

    DENSE = "dense"
    MXFP4 = "mxfp4"
    FP8_BLOCK = "fp8_block"


class Slice(NamedTuple):
    """``part[..., start:stop:step, ...]`` on ``dim`` of every part of a source (see the module docstring)."""

    dim: int
    start: int = 0
    stop: int | None = None
    step: int = 1


class SourceTensor(NamedTuple):  # a tuple: one per stored module (250,000 in the released K3)
    """One logical source tensor: stored dense, or as parts (MXFP4 codes and scales, FP8 values and
    scales...) that its encoding decodes to it."""

    module: str
    name: str  # logical name, e.g. "...experts.0.w1.weight"
    encoding: str  # an Encoding value, or a new encoding's own name
    dtype: str  # stored dtype of the values ("MXFP4" for mxfp4)
    shape: tuple[int, ...]  # logical shape
    parts: tuple[TensorInfo, ...]  # stored tensors this source consumes (values first)
    view: tuple[Slice, ...] = ()  # slices of every part this logical tensor is (empty: the whole parts)

    @property
    def file(self) -> str:
        return self.parts[0].file

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class Claim(NamedTuple):
    """One logical tensor an encoding found: it lands in the module map as ``modules[module][suffix]``."""

    module: str
    suffix: str
    source: SourceTensor


class MxCodes(NamedTuple):
    """A weight held as MXFP4 (E2M1 codes, one E8M0 byte a 32-group along K), as NVIDIA's closed-form
    MXFP4 -> NVFP4 cast reads it: its own ``k_max`` is taken here, where a NaN scale byte is refused."""

    packed: torch.Tensor  # uint8 [N, K/2]
    scale: torch.Tensor  # uint8 [N, K/32]
    k_max: int


class SourceEncoding:
    """One way a checkpoint stores a weight. Subclasses are stateless; the registry holds one instance
    each, in discovery order.

    Discovery runs in two passes over the stored tensors in header order (``plan.discover``): first every
    tensor whose last name component is in some encoding's ``anchors`` is offered to those encodings, in
    registry order, until one claims it; then every tensor nothing consumed goes through the
    :meth:`refuse_leftover` of each encoding naming its last component in ``companions``, and is claimed by
    the fallback (``anchors = None``: dense)."""

    #: ``SourceTensor.encoding`` of what this encoding claims.
    name: ClassVar[str]
    #: How the refusal of an already converted checkpoint names this encoding ("convert the original (BF16,
    #: MXFP4 or block-FP8) checkpoint instead").
    label: ClassVar[str]
    #: Last name components of the stored tensors that can start a claim; None: a fallback, offered
    #: what every other encoding left.
    anchors: ClassVar[frozenset[str] | None]
    #: Last name components of this encoding's other parts (its scales): a stored tensor with one that no
    #: claim consumed goes through :meth:`refuse_leftover`.
    companions: ClassVar[frozenset[str]] = frozenset()
    #: The ``quantization_config`` a checkpoint stored this way declares: ``quant_method`` -> the formats
    #: accepted (``format``, or each config group's). A method not declared by any encoding is refused.
    quant_configs: ClassVar[Mapping[str, frozenset[str]]] = {}
    #: Decoded values are MXFP4 codes and E8M0 scales (group 32 along K): NVIDIA's cast applies.
    holds_mxfp4: ClassVar[bool] = False

    def check_config(self, config: dict) -> None:
        """Refuse, before discovery, a config whose parameters for this encoding cannot be read."""

    def claim(self, name: str, tensors: Mapping[str, TensorInfo], config: dict) -> tuple[Claim, ...]:
        """The logical tensors the stored tensor ``name`` anchors, or () when it is not this encoding's.
        A tensor that is this encoding's but malformed (a part missing, or failing :meth:`check`) is
        refused with a ``ConvertError`` naming its file and tensor."""
        raise NotImplementedError

    def splits_experts(self, name: str, config: dict) -> bool:
        """Whether the stored tensor ``name`` is an expert bank this encoding splits, for ``config``'s model, into
        routed experts held under another module than its own (Granite's ``block_sparse_moe.input_linear.weight``
        into ``block_sparse_moe.experts.N.gate_proj``, Step-3.5's ``moe.gate_proj.weight`` into
        ``moe.experts.N.gate_proj``: ``expert_bank``): the plan's consistency check counts its claims as the experts
        it gives. A bank stored in the experts module itself (gpt-oss) needs no answer here."""
        return False

    def check(self, parts: Sequence[TensorInfo], config: dict) -> None:
        """The refusal rules on the stored parts of one weight (dtypes, shapes, the scales' shape against
        the values'), before they become a :class:`SourceTensor`."""

    def refuse_leftover(self, name: str, tensors: Mapping[str, TensorInfo]) -> None:
        """Refuse a stored tensor no encoding consumed that only makes sense as part of one of this
        encoding's weights: one of its ``companions`` (a scale) without its module's weight."""
        mod, suffix = module_of(name)
        if suffix in self.companions and f"{mod}.weight" not in tensors:
            raise refused(tensors[name], f"scale without its weight {mod}.weight(_packed)")

    def decode(self, src: SourceTensor, parts: Sequence[torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
        """The logical values: the stored tensor itself for dense, else decoded fp32 (on the parts'
        device). ``block`` is the checkpoint's FP8 block size (``fp8_block.block_size``), the one
        checkpoint-wide decoding parameter the pipeline hands its workers. Values that cannot be decoded
        (an E8M0 NaN) are refused with a ``ConvertError`` naming the tensor."""
        raise NotImplementedError

    def mxfp4_codes(self, src: SourceTensor, parts: Sequence[torch.Tensor]) -> MxCodes | None:
        """The weight as MXFP4 codes and scales for NVIDIA's cast (``holds_mxfp4``), else None."""
        return None

    def sliced(self, part: int) -> bool:
        """Whether ``SourceTensor.view`` applies to the source's ``part``-th part (every part by default).
        An encoding whose claim adds a part read whole for context (gpt-oss: the bank's scales, for the
        bank's ``k_max``) says False for it."""
        return True


def module_of(name: str) -> tuple[str, str]:
    """``("a.b", "weight")`` of ``"a.b.weight"``: a stored tensor's module and last name component."""
    mod, _, suffix = name.rpartition(".")
    return mod, suffix


def refused(info: TensorInfo, why: str) -> ConvertError:
    """The one form of a refusal of a stored tensor: its file, its name, why."""
    return ConvertError(f"{info.file}: tensor {info.name}: {why}")


def narrow(info: TensorInfo, index: int, stop: int | None = None) -> TensorInfo:
    """The part of a stored tensor that is its index ``index`` along dim 0 (that dim dropped), or rows
    ``index:stop`` (kept): a byte range of the same file, read on its own.

    The part is named ``NAME[index]`` (``NAME[index:stop]``): everything downstream keys a part by its name
    (the pipeline's read buffers, the source hashes, the manifest's source records), so parts of one
    stored tensor must not share one; :func:`stored_name` gives the stored tensor's name back."""
    row = DTYPES[info.dtype].itemsize
    for d in info.shape[1:]:
        row *= d
    if stop is None:
        return info._replace(name=f"{info.name}[{index}]", shape=info.shape[1:], start=info.start + index * row,
                             end=info.start + (index + 1) * row)
    return info._replace(name=f"{info.name}[{index}:{stop}]", shape=(stop - index, *info.shape[1:]),
                         start=info.start + index * row, end=info.start + stop * row)


def stored_name(part: TensorInfo) -> str:
    """The name of the stored tensor ``part`` is (whole, or narrowed by :func:`narrow`, once or more: an expert's
    rows ``NAME[e][0:I]``, ``expert_bank``)."""
    name = part.name
    if name.endswith("]") and "[" in name:
        return name[: name.index("[")]
    return name
