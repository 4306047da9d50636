"""NVFP4: E2M1 codes, one E4M3 scale per ``GROUP_SIZE`` values, one F32 global scale per module (or per engine
packed module: its members share it), and optionally the recipe's constant activation scale. Everything the tool
knows of the scheme itself, apart from its kernels' arithmetic (``kernels/src``: ``reference`` is ModelOpt's
math, ``ct_nvfp4`` compressed-tensors', ``nvfp4_cpu.c`` / ``nvfp4_triton`` / ``recipe_*`` the fast paths held to
their bytes):

* the tensors a module becomes and their dtypes and shapes (``roles``), and each output format's names for them,
  its quant_algo names and config groups (``SPELLINGS``; docs/nvfp4.md and docs/compressed-tensors.md cite the
  formats' sources);
* which weights it can take (``shape_error``);
* the manifest's record of a module (``record``);
* the numeric check's bound (``engine_bound``: what ``verify-manifest --engine`` holds each row to).
"""

from __future__ import annotations

from .base import Format, Spelling

NAME = Format.NVFP4.value
TITLE = "NVFP4"  # the summaries' word (plan's totals, pack's line)
CARD = "NVFP4"  # the model card's "quantized to ..." row
TOTALS = "nvfp4"  # the manifest's totals key
GROUP_SIZE = 16  # values per e4m3 scale
INPUT_SCALE = True  # a recipe may pin a constant activation scale (written with the module: W4A4)
#: how compressed-tensors names the packed NVFP4 layout (its ``format``; also every config group's)
CT_PACK_FORMAT = "nvfp4-pack-quantized"


def roles(shape: tuple[int, ...], scalar: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """dtype and shape of each role of a module of weight ``shape``: two codes a byte (even element in the low
    nibble), one e4m3 scale per group, the global and activation scales as scalars of the format's shape."""
    lead, k = shape[:-1], shape[-1]
    return {"codes": ("U8", (*lead, k // 2)), "scales": ("F8_E4M3", (*lead, k // GROUP_SIZE)),
            "global": ("F32", scalar), "input": ("F32", scalar)}


def shape_error(shape: tuple[int, ...], fused: bool, stacked: bool) -> str | None:
    """Why a weight cannot be NVFP4 (the words after "selected for NVFP4"), or None: 2-D (a fused bank of
    experts may be 3-D), K a multiple of the group."""
    if not fused and len(shape) != 2:
        return "is not 2-D"
    if shape[-1] % GROUP_SIZE:
        return f"but K={shape[-1]} is not a multiple of {GROUP_SIZE}"
    return None


def record(algo: str, shared_scale: str | None, input_scale: float | None) -> dict:
    """The manifest record's ``quantization`` entry (in every format; a format may add its own keys)."""
    return {"format": NAME, "group_size": GROUP_SIZE, "quant_algo": algo, "shared_scale": shared_scale,
            "input_scale": input_scale}


def modelopt_group(algo: str, targets: list[str]) -> dict:
    """ModelOpt's compressed-tensors-style config group of one NVFP4 quant_algo (its convert_hf_config;
    written here because ModelOpt is not a dependency of this tool)."""
    weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
    if algo == "NVFP4":
        return {"input_activations": dict(weights), "weights": weights, "targets": targets}
    return {"weights": weights, "targets": targets}


def _ct_weights() -> dict:
    """The NVFP4 presets' weights (``compressed_tensors/quantization/quant_scheme.py: NVFP4A16``), as
    ``QuantizationArgs.model_dump`` writes them (a symmetric scheme's zp_dtype None)."""
    return {"actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP_SIZE, "num_bits": 4,
            "observer": None, "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn",
            "strategy": "tensor_group", "symmetric": True, "type": "float", "zp_dtype": None}


def _ct_inputs() -> dict:
    """The NVFP4 preset's input_activations (``quant_scheme.py: NVFP4``): local scales dynamic, the global
    static (the ``input_global_scale`` tensor)."""
    return {"actorder": None, "block_structure": None, "dynamic": "local", "group_size": GROUP_SIZE, "num_bits": 4,
            "observer": "static_minmax", "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn",
            "strategy": "tensor_group", "symmetric": True, "type": "float", "zp_dtype": None}


def ct_group(algo: str, targets: list[str]) -> dict:
    """compressed-tensors' config group of one preset scheme (``NVFP4A16``, or ``NVFP4`` with a constant
    activation global scale)."""
    return {"format": CT_PACK_FORMAT, "input_activations": _ct_inputs() if algo == "NVFP4" else None,
            "output_activations": None, "targets": targets, "weights": _ct_weights()}


SPELLINGS = {
    # ModelOpt: value = code * weight_scale * weight_scale_2; vLLM's and SGLang's ModelOpt FP4 loaders
    "modelopt": Spelling(tensors=(("codes", ".weight"), ("scales", ".weight_scale"), ("global", ".weight_scale_2"),
                                  ("input", ".input_scale")),
                         algos=("W4A16_NVFP4", "NVFP4"), layer_keys=(("group_size", GROUP_SIZE),),
                         group=modelopt_group),
    # compressed-tensors: the global scale's reciprocal convention (code * weight_scale / weight_global_scale), the
    # activation scale as 1/input_scale (compressors/nvfp4/base.py: NVFP4PackedCompressor.compression_param_names)
    "compressed-tensors": Spelling(tensors=(("codes", ".weight_packed"), ("scales", ".weight_scale"),
                                            ("global", ".weight_global_scale"), ("input", ".input_global_scale")),
                                   algos=("NVFP4A16", "NVFP4"), scalar=(1,), reciprocal_input=True, group=ct_group,
                                   arithmetic="compressed-tensors"),
}
