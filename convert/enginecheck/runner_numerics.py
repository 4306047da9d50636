"""What both engine runners share for the numeric check: each weight read as the engine's GEMM reads it.

Where the engine has CPU-runnable code for a reading, the check runs it: each engine's own Triton block-FP8
GEMM in Triton's interpreter (``_kernel_read``: the identity times the weight) and vLLM's NVFP4 emulation
(``engine_nvfp4``); its NVFP4 GEMMs proper are CUDA kernels (CUTLASS, flashinfer, Marlin), so elsewhere the
cited rules below are applied.

Runs inside an engine's own python (started by ``kimi_convert.enginecheck``): only the standard library,
torch and safetensors. After the engine's ``load_weights``, every linear and MoE layer's weight is
dequantized to fp32 **from the parameters the engine holds**, with the engine's own conventions (each
rule below cites the engine file and function it follows):

* NVFP4 (ModelOpt): ``e2m1[code] * fp32(e4m3 block scale) * global``; the global scale is the one value
  the engine keeps for a fused layer: ``weight_scale_2.max()`` over the shard slots of a linear layer, and
  the gate's ``w13_weight_scale_2[:, 0]`` for both halves of an expert's w13.
* 128x128 block FP8: row ``r``, column ``c`` of the (fused) weight uses scale ``[r // 128, c // 128]`` of
  the (fused) scale tensor: the engines' block-scaled GEMMs index their scale grid that way.
* MXFP4 experts (kept as the source stores them, e.g. DeepSeek V4's MTP experts under ``nvidia-dsv4``):
  ``e2m1[code] * 2^(e8m0 - 127)`` per 32 values, the OCP MX reading both engines' MXFP4 MoE methods hold.
* unquantized layers: the parameter as stored.

It also turns the load tracker's observed writes into **placements**: for every checkpoint tensor, which
rows of which parameter (and which expert) its bytes landed in. The parent process compares those rows
of the engine's reading with the source's own weight for the same rows.
"""

from __future__ import annotations

import math
import os
import re

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
TILE = 128

#: Rules, cited from the engines' installed source (file: function): what the GEMM reads.
RULES = {
    ("vllm", "nvfp4"): "vllm/model_executor/layers/quantization/modelopt.py: KNvfp4Static.process "
                       "(weight_global_scale = weight_scale_2.max(), run here) and "
                       "utils/nvfp4_emulation_utils.py: dequantize_to_dtype (code * scale * global)",
    ("vllm", "fp8-block"): "vllm/model_executor/layers/quantization/modelopt.py: KFp8Block128.process and "
                           "_Fp8PbWoPartialBlock.post_process (run here); the block GEMM reads scale "
                           "[r // 128, c // 128] (layers/quantization/utils/fp8_utils.py: w8a8_block_fp8_matmul)",
    ("vllm", "nvfp4-moe"): "vllm/model_executor/layers/quantization/modelopt.py: "
                           "ModelOptNvFp4FusedMoE.process_weights_after_loading (one w13 global scale: "
                           "w13_weight_scale_2[:, 0]; not run: it converts to the GPU backend's layout)",
    ("sglang", "nvfp4"): "sglang/srt/layers/quantization/modelopt_quant.py: ModelOptFp4LinearMethod / "
                         "ModelOptNvFp4A16LinearMethod.process_weights_after_loading (weight_scale_2.max(); "
                         "not run: flashinfer / Marlin repack on the GPU)",
    ("sglang", "fp8-block"): "sglang/srt/layers/quantization/fp8_kernel.py: w8a8_block_fp8_matmul (scale "
                             "weight_scale_inv[r // 128, c // 128]); process_weights_after_loading not run (GPU)",
    ("sglang", "nvfp4-moe"): "sglang/srt/layers/quantization/modelopt_quant.py: "
                             "ModelOptNvFp4FusedMoEMethod.process_weights_after_loading and _compute_gemm1_alphas "
                             "(Marlin and the single-alpha backends read w13_weight_scale_2[:, 0] for both halves; "
                             "not run: GPU layouts)",
    ("vllm", "ct-nvfp4"): "vllm/model_executor/layers/quantization/compressed_tensors/schemes/"
                          "compressed_tensors_w4a4_nvfp4.py: CompressedTensorsW4A4Fp4.process_weights_after_loading "
                          "(weight_global_scale = 1 / weight_global_scale.max(), run here) and "
                          "utils/nvfp4_emulation_utils.py: dequantize_to_dtype (code * scale * global)",
    ("sglang", "ct-nvfp4"): "sglang/srt/layers/quantization/compressed_tensors/schemes/"
                            "compressed_tensors_w4a16_nvfp4.py: "
                            "CompressedTensorsW4A16Fp4.process_weights_after_loading (refuses fused projections "
                            "whose weight_global_scale differ; weight_scale_2 = 1 / weight_global_scale[0]; run "
                            "here up to its GPU repack)",
    ("vllm", "ct-nvfp4-moe"): "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
                              "compressed_tensors_moe_w4a4_nvfp4.py: CompressedTensorsW4A4Nvfp4MoEMethod."
                              "process_weights_after_loading (w13 read with 1 / w13_weight_global_scale[:, 0]; "
                              "not run: GPU layouts)",
    ("sglang", "ct-nvfp4-moe"): "sglang/srt/layers/quantization/compressed_tensors/schemes/"
                                "compressed_tensors_w4a16_nvfp4_moe.py: process_weights_after_loading (refuses "
                                "experts whose w1 and w3 global scales differ; 1 / w13_weight_global_scale[:, 0]; "
                                "not run: Marlin layouts)",
    ("vllm", "mxfp4-moe"): "vllm/model_executor/layers/quantization/mxfp4.py: Mxfp4MoEMethod.create_weights "
                           "(uint8 E2M1 codes [E, N, K/2], uint8 E8M0 scales [E, N, K/32]; the OCP MX reading "
                           "code * 2^(scale - 127), utils/mxfp4_utils.py: dequant_mxfp4, whose CPU path needs "
                           "amd-quark; not run: process_weights_after_loading converts to the GPU backend's layout)",
    ("sglang", "mxfp4-moe"): "sglang/srt/layers/quantization/mxfp4_flashinfer_trtllm_moe.py: "
                             "Mxfp4FlashinferTrtllmMoEMethod.create_weights (int8 E2M1 codes, fp32 scales "
                             "w13_weight_scale_inv per 32) and process_weights_after_loading (the scales cast "
                             "to float8_e8m0fnu by value, w1/w3 reordered and shuffled for TRT-LLM; not run: GPU)",
    ("any", "dense"): "unquantized layer: the parameter as loaded",
}


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """fp32 values of packed E2M1 codes [..., K/2] -> [..., K] (even element in the low nibble)."""
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
    return table[codes.long()]


def nvfp4(weight: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor, group: int = 16) -> torch.Tensor:
    """``code * fp32(scale) * global`` for [..., N, K/2] codes, [..., N, K/g] scales, a global per leading index."""
    vals = e2m1_values(weight)
    k = vals.shape[-1]
    s = scale.view(torch.float8_e4m3fn).float() if scale.dtype != torch.float8_e4m3fn else scale.float()
    g = glob.float().reshape(*glob.shape, *([1] * (s.dim() - glob.dim())))
    blocks = vals.reshape(*vals.shape[:-1], k // group, group)
    return (blocks * (s * g).unsqueeze(-1)).reshape(vals.shape)


def engine_nvfp4(engine: str, weight: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor
                 ) -> tuple[torch.Tensor, str]:
    """NVFP4 read by the engine's own code where it has a CPU path (vLLM's emulation,
    ``nvfp4_emulation_utils.dequantize_to_dtype``, the reference its NVFP4 backends are tested against), else by
    ``nvfp4`` (the same product); returns the values and which was used."""
    if engine == "vllm":
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

        g = glob.float().reshape(-1) if weight.dim() == 3 else glob.float().reshape(())
        out = dequantize_to_dtype(weight.contiguous(), scale.contiguous(), g, torch.float32, 16, swizzle=False)
        return out, "vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py: dequantize_to_dtype"
    return nvfp4(weight, scale, glob), "code * scale * global (this check's own product)"


def mxfp4(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``code * 2^(e - 127)`` for [..., N, K/2] codes (int8 or uint8: the same bytes) and [..., N, K/32] scales:
    uint8 or float8_e8m0fnu are E8M0 bytes, a float tensor holds the scale's value (SGLang's fp32 parameter,
    which its process_weights_after_loading casts to E8M0 by value)."""
    vals = e2m1_values(weight.view(torch.uint8))
    s = torch.exp2(scale.float() - 127.0) if scale.dtype == torch.uint8 else scale.float()
    blocks = vals.reshape(*vals.shape[:-1], vals.shape[-1] // 32, 32)
    return (blocks * s.unsqueeze(-1)).reshape(vals.shape)


def tile_scales(scale: torch.Tensor) -> torch.Tensor:
    """A block-FP8 scale tensor as its fp32 [row tiles, column tiles] grid: vLLM's and ModelOpt's
    ``[ceil(N/128), 1, ceil(K/128), 1]``, SGLang's squeezed ``[ceil(N/128), ceil(K/128)]``."""
    s = scale.float()
    return s[:, 0, :, 0] if s.dim() == 4 else s.reshape(s.shape[0], -1)


def fp8_block(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``w[r, c] * scale[r // 128, c // 128]`` (``tile_scales``' grid)."""
    n, k = weight.shape
    full = tile_scales(scale).repeat_interleave(TILE, 0)[:n].repeat_interleave(TILE, 1)[:, :k]
    return weight.float() * full


class _NoKernel:
    """Stands in for a vLLM GEMM kernel object while its method's processing runs: the kernel's own
    ``process_weights_after_loading`` only repacks the processed weight into its GPU layout."""

    def __init__(self, kernel):
        self.kernel = kernel

    def process_weights_after_loading(self, layer) -> None:
        return None

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def _vllm_process(module) -> str:
    """Run vLLM's ModelOptLinearMethod.process_weights_after_loading (its scale reductions, squeezes and
    paddings) with the GEMM kernel's layout repack left out; returns what ran."""
    return _without_repack(module.quant_method, module)


def _without_repack(method, module) -> str:
    """``method.process_weights_after_loading(module)`` with its GEMM kernel (the layout repack) stubbed out."""
    kernel = getattr(method, "kernel", None)
    method.kernel = _NoKernel(kernel)
    try:
        method.process_weights_after_loading(module)
    finally:
        method.kernel = kernel
    return f"process_weights_after_loading run, the {type(kernel).__name__} layout repack left out"


def _p(module, name: str):
    t = module._parameters.get(name)
    if t is None:
        t = module._buffers.get(name)
    return t if t is None else t.data


def _ct_process(engine: str, module) -> str:
    """Run the layer's compressed-tensors scheme's process_weights_after_loading: vLLM's with the GEMM kernel's
    repack left out; SGLang's up to its GPU repack (its refusal of unshared global scales comes first and is
    raised; what fails after it on the CPU is the repack, which reads nothing this check needs)."""
    scheme = getattr(module, "scheme", None)
    if scheme is None:
        return "no scheme"
    if engine == "vllm":
        return _without_repack(scheme, module)
    import sys

    home = sys.modules[type(scheme).__module__]
    repack = getattr(home, "prepare_nvfp4_layer_for_marlin", None)
    if repack is not None:  # reached on the CPU, it JIT-builds a CUDA kernel with ninja first (minutes, then fails)
        home.prepare_nvfp4_layer_for_marlin = _stop_at_repack
    try:
        scheme.process_weights_after_loading(module)
    except _RepackReached:
        return "process_weights_after_loading run up to its Marlin repack (prepare_nvfp4_layer_for_marlin)"
    except Exception as e:  # the GPU repack (flashinfer / Marlin), after the checks; the scale refusal is raised
        if isinstance(e, ValueError) and "weight_global_scale" in str(e):
            raise
        return f"process_weights_after_loading run up to the GPU repack ({type(e).__name__})"
    finally:
        if repack is not None:
            home.prepare_nvfp4_layer_for_marlin = repack
    return "process_weights_after_loading run"


class _RepackReached(Exception):
    """SGLang's processing reached its GPU repack: every check before it has passed."""


def _stop_at_repack(layer) -> None:
    raise _RepackReached


def read_ct_linear(engine: str, entry: dict, module) -> dict:
    """A compressed-tensors NVFP4 linear layer: ``code * scale / weight_global_scale``, with the one global scale
    the engine keeps (vLLM: the max of the shard slots' divisors; SGLang: refuses unequal slots)."""
    packed, scale = _p(module, "weight_packed").clone(), _p(module, "weight_scale").clone()
    slots = _p(module, "weight_global_scale").float().clone().reshape(-1)
    processed = _ct_process(engine, module)
    mult = 1.0 / slots.max()
    if engine == "vllm" and _p(module, "weight_global_scale") is not None:
        mult = _p(module, "weight_global_scale").float().reshape(())  # the processed parameter: 1 / max
    entry["weight"], by = engine_nvfp4(engine, packed, scale, mult.reshape(()))
    entry.update(param=f"{entry['module']}.weight_packed", scheme="nvfp4", convention="compressed-tensors",
                 rule=RULES[(engine, "ct-nvfp4")], processed=processed, global_slots=(1.0 / slots).tolist(),
                 global_scale=float(mult), read_by=by)
    return entry


def read_linear(engine: str, name: str, module) -> dict | None:
    """The weight of one linear layer as the engine's GEMM reads it, or None when it has no weight."""
    qm = getattr(module, "quant_method", None)
    qname = type(qm).__name__ if qm is not None else None
    packed = _p(module, "weight_packed")
    if isinstance(packed, torch.Tensor) and packed.dtype == torch.uint8 and packed.dim() == 2 \
            and _is_nvfp4_scale(_p(module, "weight_scale"), packed):
        entry = {"module": name, "kind": "linear", "method": qname, "class": type(module).__name__,
                 "widths": [int(x) for x in getattr(module, "output_sizes", None)
                            or getattr(module, "logical_widths", None) or []]}
        return read_ct_linear(engine, entry, module)
    w = _p(module, "weight")
    if w is None or w.dim() != 2:
        return None
    entry = {"module": name, "kind": "linear", "method": qname, "class": type(module).__name__,
             "param": f"{name}.weight", "widths": [int(x) for x in getattr(module, "output_sizes", None)
                                                   or getattr(module, "logical_widths", None) or []]}
    if w.dtype == torch.uint8 and _p(module, "weight_scale") is not None:
        processed = None
        slots = _p(module, "weight_scale_2").float().clone()  # the shard slots, before any reduction
        if engine == "vllm" and qname == "ModelOptLinearMethod":
            processed = _vllm_process(module)
            glob = _p(module, "weight_global_scale")
            w = _p(module, "weight")
        else:
            glob = slots.max()
        entry["weight"], by = engine_nvfp4(engine, w, _p(module, "weight_scale"), glob.reshape(()))
        entry.update(scheme="nvfp4", rule=RULES[(engine, "nvfp4")], processed=processed or "not run",
                     global_slots=slots.reshape(-1).tolist(), global_scale=float(glob), read_by=by)
        return entry
    if w.dtype == torch.float8_e4m3fn:
        processed = None
        if engine == "vllm" and qname == "ModelOptLinearMethod":
            processed = _vllm_process(module)
            w = _p(module, "weight")
        scale = _p(module, "weight_scale_inv")
        if scale is None:
            scale = _p(module, "weight_scale")
        if scale is None or scale.numel() <= 1:
            entry.update(scheme="fp8-tensor", rule="per-tensor FP8: no read rule in this check",
                         unread=True)
            return entry
        entry.update(scheme="fp8-block", rule=RULES[(engine, "fp8-block")], processed=processed or "not run")
        entry["weight"] = fp8_block(w, scale)
        _kernel_read(engine, entry, w, scale)
        return entry
    if w.is_floating_point():
        entry.update(scheme="dense", rule=RULES[("any", "dense")], processed="not needed", dtype=str(w.dtype))
        entry["weight"] = w.float()
        return entry
    entry.update(scheme=str(w.dtype), rule="no read rule in this check", unread=True)
    return entry


#: The largest weight (elements) whose GEMM is run in Triton's interpreter: the kernel multiplies an identity
#: of K rows by the weight, K x N x K multiply-adds in numpy.
KERNEL_READ_MAX = 1 << 22


#: Each engine's own Triton block-FP8 GEMM (file: function), run in Triton's interpreter by ``_kernel_read``.
BLOCK_FP8_KERNELS = {
    "vllm": ("vllm.model_executor.layers.quantization.utils.fp8_utils", "w8a8_triton_block_scaled_mm"),
    "sglang": ("sglang.kernels.ops.gemm.fp8_kernel", "w8a8_block_fp8_matmul_triton"),
}


def _kernel_read(engine: str, entry: dict, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Where Triton runs interpreted (``TRITON_INTERPRET=1``: the engine check sets it with the numeric
    check), the engine's own block-FP8 GEMM multiplies the identity by the weight: its output is the weight
    exactly as the kernel reads it (one product a term, fp32 accumulate), and it replaces the rule's
    reading; ``kernel_read`` says how the two compared. Larger weights keep the rule's reading."""
    if os.environ.get("TRITON_INTERPRET") != "1" or weight.numel() > KERNEL_READ_MAX:
        return
    import importlib

    module, fn = BLOCK_FP8_KERNELS[engine]
    gemm = getattr(importlib.import_module(module), fn)
    n, k = weight.shape
    s = tile_scales(scale)
    eye = torch.eye(k, dtype=torch.float32).to(torch.float8_e4m3fn)
    ones = torch.ones(k, -(-k // TILE), dtype=torch.float32)
    out = gemm(eye, weight.contiguous(), ones, s.contiguous(), [TILE, TILE], output_dtype=torch.float32)
    read = out.t().contiguous()
    entry["kernel_read"] = {"kernel": f"{module.replace('.', '/')}.py: {fn}, run in Triton's interpreter",
                            "max_abs_diff_from_rule": float((read - entry["weight"]).abs().max()), "rows": n}
    entry["weight"] = read


def read_moe(engine: str, name: str, module) -> list[dict]:
    """An MoE layer's w13 and w2 as the engine's grouped GEMMs read them (one entry each)."""
    qm = getattr(module, "quant_method", None)
    qname = type(qm).__name__ if qm is not None else None
    out = []
    for which in ("w13", "w2"):
        w = _p(module, f"{which}_weight")
        if w is None and _is_nvfp4_scale(_p(module, f"{which}_weight_scale"), _p(module, f"{which}_weight_packed")):
            out.append(_read_ct_moe(engine, name, module, which, qname))
            continue
        if w is None or w.dim() != 3:
            continue
        entry = {"module": name, "kind": "moe", "method": qname, "class": type(module).__name__,
                 "param": f"{name}.{which}_weight", "which": which}
        s = _p(module, f"{which}_weight_scale")
        s2 = _p(module, f"{which}_weight_scale_2")
        if w.dtype == torch.uint8 and s is not None and s2 is not None:
            slots = s2.float().reshape(s2.shape[0], -1)
            glob = slots[:, 0]  # gate's scale for both halves of w13; w2 has one
            entry["weight"], by = engine_nvfp4(engine, w, s, glob)
            entry.update(scheme="nvfp4", rule=RULES[(engine, "nvfp4-moe")], processed="not run",
                         global_slots=slots.tolist(), read_by=by)
        elif w.is_floating_point():
            entry.update(scheme="dense", rule=RULES[("any", "dense")], processed="not needed", dtype=str(w.dtype))
            entry["weight"] = w.float()
        elif _is_mxfp4(w, sx := s if s is not None else _p(module, f"{which}_weight_scale_inv"), s2):
            entry["weight"] = mxfp4(w, sx)
            entry.update(scheme="mxfp4", rule=RULES[(engine, "mxfp4-moe")], processed="not run",
                         read_by="code * 2^(scale - 127) (this check's own product)")
        else:
            entry.update(scheme=str(w.dtype), rule=f"no read rule in this check for {qname}", unread=True)
        out.append(entry)
    return out


def _is_mxfp4(w: torch.Tensor, scale, scale_2) -> bool:
    """MXFP4 experts as both engines' MXFP4 MoE methods hold them: 8-bit codes, one scale per 32 values (16
    bytes), no second-level scale."""
    return (w.dtype in (torch.uint8, torch.int8) and scale_2 is None and isinstance(scale, torch.Tensor)
            and scale.dim() == w.dim() and scale.shape[-1] * 16 == w.shape[-1])


def _is_nvfp4_scale(scale, packed) -> bool:
    """A compressed-tensors NVFP4 layer: e4m3 scales, one per 16 values (MXFP4's ``weight_packed`` has E8M0 uint8
    scales per 32: not read by this rule)."""
    return (isinstance(scale, torch.Tensor) and isinstance(packed, torch.Tensor) and scale.dtype == torch.float8_e4m3fn
            and scale.shape[-1] * 8 == packed.shape[-1])


def _read_ct_moe(engine: str, name: str, module, which: str, qname: str | None) -> dict:
    """compressed-tensors NVFP4 experts: ``code * scale / global[:, 0]`` (both engines read w13 with the gate's
    divisor; SGLang refuses experts whose w1 and w3 divisors differ, as its process_weights_after_loading does)."""
    w, s = _p(module, f"{which}_weight_packed"), _p(module, f"{which}_weight_scale")
    slots = _p(module, f"{which}_weight_global_scale").float().reshape(w.shape[0], -1)
    entry = {"module": name, "kind": "moe", "method": qname, "class": type(module).__name__,
             "param": f"{name}.{which}_weight_packed", "which": which}
    mismatched = (slots != slots[:, :1]).any(dim=1)
    if engine == "sglang" and mismatched.any():
        experts = mismatched.nonzero().flatten().tolist()
        entry["error"] = ("ValueError: NVFP4 weight-only MoE requires the gate and up projections of each expert to "
                          f"share one weight_global_scale; experts {experts[:8]} differ (SGLang's check, "
                          "compressed_tensors_w4a16_nvfp4_moe.py: process_weights_after_loading)")
        return entry
    entry["weight"], by = engine_nvfp4(engine, w, s, 1.0 / slots[:, 0])
    entry.update(scheme="nvfp4", convention="compressed-tensors", rule=RULES[(engine, "ct-nvfp4-moe")],
                 processed="not run", global_slots=(1.0 / slots).tolist(), read_by=by)
    return entry


def _is_moe(module) -> bool:
    return any(isinstance(_p(module, f"{w}{suf}"), torch.Tensor) for w in ("w13", "w2")
               for suf in ("_weight", "_weight_packed"))


def read_model(engine: str, model) -> list[dict]:
    """Every linear and MoE layer of ``model`` read as its GEMM reads it."""
    entries = []
    for name, module in model.named_modules():
        try:
            if _is_moe(module):
                entries += read_moe(engine, name, module)
            elif hasattr(module, "quant_method") or isinstance(module, torch.nn.Linear):
                e = read_linear(engine, name, module)
                if e is not None:
                    entries.append(e)
        except Exception as e:  # the engine's own processing refused the layer: a finding, reported
            entries.append({"module": name, "kind": "linear", "param": f"{name}.weight", "class": type(module).__name__,
                            "method": type(getattr(module, "quant_method", None)).__name__,
                            "error": f"{type(e).__name__}: {e}"[:600]})
    return entries


def placements(tracker, params: dict[str, torch.Tensor]) -> dict[str, list[dict]]:
    """For each checkpoint tensor: the rows (and expert) of each weight parameter its bytes were written to, where in
    the tensor they came from (``src_row``; for a stored 3-D tensor, an expert bank, also ``src_expert``: the leading
    index, the row within it), and its place in the order the engine's iterator offered the tensors (``seq``: which of
    two writes to the same rows came last).

    A bank's loader writes one expert at a time from a view of the stored tensor (vLLM 0.33 ``step3_text.py``
    ``Step3TextModel.load_weights`` and ``models/step5/nvidia/model.py``: ``weight_loader(param,
    loaded_weight[expert_id], ...)``; SGLang 0.5.23 ``iquest_q1.py`` ``load_iquest_q1_weights``:
    ``loaded_weight[e][:I]`` / ``[I:]``), so the byte a write starts from says which expert and row it holds. A write
    over several experts of a 3-D parameter from a stored 3-D tensor (a whole bank in one copy) is placed expert by
    expert, the parameter's expert ``i`` from the stored tensor's ``src_expert + i``; any other write across experts
    is one placement without rows (a problem of the check)."""
    out: dict[str, list[dict]] = {}
    seq = {t: i for i, t in enumerate(tracker.offered_order)}  # (the last offer of a name repeated)
    for (tensor, pname), spans in tracker.spans.items():
        p = params.get(pname)
        if p is None or not pname.endswith(("weight", "weight_packed")) or p.dim() not in (2, 3):
            continue
        stride = p.stride()
        info = tracker.offered.get(tensor, {})
        for rel, shape, wstride, src, step in spans:
            if not shape or 0 in shape:
                continue
            src_expert, src_row, src_step = _source_index(src, step, info)
            last = rel + sum((n - 1) * s for n, s in zip(shape, wstride, strict=True))
            first_idx, last_idx = _index(rel, stride), _index(last, stride)
            spot = {"param": pname, "src_row": src_row, "seq": seq.get(tensor)}
            if src_expert is not None:
                spot["src_expert"] = src_expert
            if src_step != 1:
                spot["src_step"] = src_step
            if p.dim() == 2:
                out.setdefault(tensor, []).append({**spot, "row": first_idx[0], "rows": last_idx[0] - first_idx[0] + 1})
            elif first_idx[0] == last_idx[0]:
                out.setdefault(tensor, []).append({**spot, "expert": first_idx[0], "row": first_idx[1],
                                                   "rows": last_idx[1] - first_idx[1] + 1})
            elif src_expert is not None and len(shape) == 3 and wstride[0] == stride[0]:
                inner = _index(rel + sum((n - 1) * s for n, s in zip(shape[1:], wstride[1:], strict=True)), stride)
                out.setdefault(tensor, []).extend(
                    {**spot, "expert": first_idx[0] + i, "row": first_idx[1], "rows": inner[1] - first_idx[1] + 1,
                     "src_expert": src_expert + i} for i in range(shape[0]))
            else:
                out.setdefault(tensor, []).append({"param": pname, "experts": [first_idx[0], last_idx[0]],
                                                   "row": first_idx[1], "rows": None})
    return out


def _source_index(src: int | None, step: int | None, info: dict) -> tuple[int | None, int | None, int]:
    """Where a write's rows are in the offered tensor, from its first byte (``src``: its offset there, None where
    derived from all of it) and the bytes from one row read to the next (``step``, ``runner_common._row_step``):
    (the leading index of a stored 3-D tensor (an expert bank [E, N, K]) or None for a 1-D or 2-D one, the first
    row (within that slice) or None where the byte does not start one, the stored rows from one row read to the
    next: 1 as stored, 2 for every other row, 0 where the read is not rows of it (a transposed view))."""
    shape, size = info.get("shape"), _ITEMSIZE.get(info.get("dtype", ""))
    if src is None or not shape or size is None:
        return None, None, 1
    bank = len(shape) >= 3
    lead, row = size * math.prod(shape[1:]), size * math.prod(shape[2 if bank else 1:])
    if not lead or not row:
        return None, None, 1
    rows = 1 if step is None or len(shape) < 2 else (step // row if step > 0 and step % row == 0 else 0)
    if not bank:
        return None, (None if src % lead else src // lead), rows
    expert, rest = divmod(src, lead)
    return expert, (None if rest % row else rest // row), rows


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "uint8": 1, "int8": 1,
             "float8_e4m3fn": 1, "float8_e5m2": 1, "int32": 4, "int64": 8}


def _index(offset: int, stride: tuple[int, ...]) -> list[int]:
    idx = []
    for s in stride:
        q, offset = divmod(offset, s) if s else (0, offset)
        idx.append(q)
    return idx


#: The engines' loaders that reorder a checkpoint tensor's rows before writing them (method name on the model or a
#: submodule); ``row_orders`` runs each on an index tensor, so the order is the engine's own.
ROW_REORDERS = ("permute_qk_weight_for_rotary",)
#: The module names whose weights those steps can reorder (both engines' ``permute_qk_weight_for_rotary`` test
#: ``"wq" / "q_proj" / "wk" / "k_proj" in name.split(".")`` first): no index tensor is built for any other weight
#: (an embedding's would be as large as the checkpoint's own).
REORDERED_MODULES = frozenset({"wq", "q_proj", "wk", "k_proj"})


def _reorderer(model):
    """The engine's own row-reordering load step and where it is (``file: Class.method``), or None: vLLM's
    ``llama4.py`` ``Llama4ForCausalLM.permute_qk_weight_for_rotary`` (the text class itself, or the
    ``language_model`` of ``mllama4.py`` ``Llama4ForConditionalGeneration``, whose ``load_weights`` hands it every
    ``language_model.`` weight), SGLang's ``mllama4.py`` ``Llama4ForConditionalGeneration.permute_qk_weight_for_rotary``
    (called by its ``load_weights`` for every name without ``vision``)."""
    for module in model.modules():
        for attr in ROW_REORDERS:
            fn = getattr(type(module), attr, None)
            if callable(fn):
                where = f"{type(module).__module__.replace('.', '/')}.py: {type(module).__name__}.{attr}"
                return getattr(module, attr), where
    return None


def row_orders(model, tracker) -> dict[str, dict]:
    """For each offered 2-D weight whose rows the engine's loader reorders: ``order`` (the source row behind each row
    it writes) and ``by``. Found by running the engine's own step on a tensor of the same shape holding each row's
    index (so its conditions, names and head counts are the engine's); vision weights never reach it in either
    engine's ``load_weights`` (above). A step that raises on the index tensor raised on the weight as well: the
    load failed and there is nothing to read."""
    found = _reorderer(model)
    if found is None:
        return {}
    fn, where = found
    out = {}
    for name, info in tracker.offered.items():
        shape = info.get("shape") or []
        if ("vision" in name or len(shape) != 2 or not name.endswith(("weight", "weight_packed"))
                or not REORDERED_MODULES & set(name.split("."))):
            continue
        index = torch.arange(shape[0], dtype=torch.float32).unsqueeze(1).repeat(1, shape[1])  # exact to 2^24 rows
        try:
            _, moved = fn(name, index)
        except Exception:  # the engine's own load raised the same on the real tensor
            continue
        order = moved[:, 0].long()
        if moved.shape == index.shape and not torch.equal(order, torch.arange(shape[0])):
            out[name] = {"order": order.tolist(), "by": where}
    return out


def dump(engine: str, model, tracker, folder: str, skip: set[str] | None = None) -> dict:
    """Read every layer (but those whose weight is in ``skip``: a draft's parameters the engine replaces with the
    target model's), write the fp32 weights to ``folder/numerics.safetensors`` and return the index."""
    from safetensors.torch import save_file

    params = dict(tracker.params)
    entries = [e for e in read_model(engine, model) if e["param"] not in (skip or ())]
    tensors = {}
    for e in entries:
        w = e.pop("weight", None)
        if w is not None:
            key = f"{len(tensors):05d}:{e['param']}"
            tensors[key] = w.contiguous()
            e["key"] = key
            e["shape"] = list(w.shape)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "numerics.safetensors"))
    placed = placements(tracker, params)
    for name, how in row_orders(model, tracker).items():
        for spot in placed.get(name, []):
            spot.update(row_order=how["order"], row_order_by=how["by"])
    return {"layers": entries, "placements": placed,
            "weight_params": sorted(n for n in params if re.search(r"weight(_packed)?$", n))}
