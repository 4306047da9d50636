"""The stand-in a derivation shows the engines: the source's config and its weights' names and logical shapes.

The engines are asked how THEY build and load a checkpoint of the source's architecture, with no table of ours in
between: each engine builds its registered model class from the stand-in's config and its own loader is offered a
zero tensor of every logical weight (``runner_common.spec_weights``). The stand-in is the source as this tool's
dense output would store it: every weight under its logical name (``....weight``) and logical shape, in BF16 where
the source stores it in another encoding (FP8 blocks, MXFP4); every other tensor as stored. Its config is the
source's without ``quantization_config`` (the trace's build is unquantized); ``quant_configs`` are the two output
formats' configs with nothing ignored, which the module builds are made under.

Pure (no torch, no engine): what it returns is written as files by :func:`write`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .. import mistral_checkpoint
from ..checkpoint import Checkpoint
from ..errors import ConvertError
from ..plan.discover import discover_sources
from . import reduce

#: safetensors dtype -> torch dtype name (what the runner's zeros are made of)
TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}

#: A stand-in larger than this is reduced first (``reduce``: fewer layers, experts and vocabulary rows).
REDUCE_ABOVE = 512 << 20

#: The largest stand-in offered whole (bytes of its zeros, held one tensor at a time by the loader but built in
#: full by the engine's model): a larger source needs a reduced config, which this version does not make.
MAX_BYTES = 6 << 30

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
          "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}

#: The output formats' quantization configs, nothing ignored: which layers each engine builds unquantized whatever
#: the checkpoint's exclude list says (as this tool writes them: formats/modelopt.py, formats/compressed_tensors.py).
QUANT_CONFIGS = {
    "modelopt": {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16, "ignore": [],
                 "kv_cache_quant_algo": None,
                 "config_groups": {"group_0": {"weights": {"dynamic": False, "num_bits": 4, "type": "float",
                                                           "group_size": 16}, "targets": ["Linear"]}}},
    "compressed-tensors": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": [],
        "quantization_status": "compressed", "kv_cache_scheme": None,
        "config_groups": {"NVFP4A16": {"format": "nvfp4-pack-quantized", "targets": ["Linear"],
                                       "input_activations": None, "output_activations": None,
                                       "weights": {"dynamic": False, "group_size": 16, "num_bits": 4,
                                                   "strategy": "tensor_group", "symmetric": True, "type": "float",
                                                   "scale_dtype": "torch.float8_e4m3fn", "observer": None,
                                                   "observer_kwargs": {}, "actorder": None,
                                                   "block_structure": None, "zp_dtype": None}}}},
}


@dataclass(frozen=True)
class StandIn:
    config: dict  # the source's config.json, quantization_config removed
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]  # (logical name, logical shape, torch dtype name)
    side_files: dict[str, bytes]  # small files the engines' config parsing may read (generation_config.json...)
    reduction: str = ""  # what ``reduce`` cut, in words ("" where the source is offered at its size)

    @property
    def nbytes(self) -> int:
        total = 0
        for _, shape, dt in self.tensors:
            n = 1
            for d in shape:
                n *= d
            total += n * _BYTES[dt]
        return total


def _config(ckpt: Checkpoint) -> dict:
    config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    if mistral_checkpoint.in_layout(ckpt.source):  # the engines build their model from more than the plan reads
        config = {**config, **mistral_checkpoint.build_keys(config)}
    text = config.get("text_config")
    if isinstance(text, dict) and "quantization_config" in text:
        config["text_config"] = {k: v for k, v in text.items() if k != "quantization_config"}
    return config


def make(ckpt: Checkpoint, with_code: bool = False) -> StandIn:
    """The stand-in of ``ckpt``: every logical tensor discovery finds, dense (see the module docstring). ``with_code``:
    also its top-level ``.py`` files, the config code ``auto_map`` names, which an engine told to trust remote code
    imports from the folder."""
    tensors = []
    for module, by_suffix in discover_sources(ckpt).items():
        for suffix, src in by_suffix.items():
            name = f"{module}.{suffix}" if module else suffix
            if src.encoding == "dense" and not src.view:
                dtype = TORCH_DTYPES.get(src.dtype)
                if dtype is None:
                    raise ConvertError(f"{name}: dtype {src.dtype} cannot be offered to an engine")
            else:
                dtype = "bfloat16"
            tensors.append((name, tuple(src.shape), dtype))
    side = {}
    for rel in ckpt.side_files:
        low = rel.lower()
        if "/" in rel or not low.endswith((".json", ".py") if with_code else ".json") or low in (
                "config.json", "hf_quant_config.json"):
            continue
        entry = ckpt.source.entry(rel)
        if entry is None or entry.size >= (1 << 20):
            continue
        with ckpt.source.open(rel) as f:
            side[rel] = f.read_range(0, entry.size)
    out = StandIn(_config(ckpt), tuple(tensors), side)
    if out.nbytes > REDUCE_ABOVE:
        out = reduced(out)
    if out.nbytes > MAX_BYTES:
        raise ConvertError(f"{ckpt.source}: reduced to {out.reduction}, its {out.nbytes / 1e9:.1f} GB of weights are "
                           f"still more than a derivation offers an engine ({MAX_BYTES / 1e9:.1f} GB); derive from a "
                           "smaller checkpoint of the architecture and pass the table to pack with --mapping")
    return out


def reduced(s: StandIn) -> StandIn:
    """``s`` cut to each kind of layer once, a few experts a bank and a small vocabulary (``reduce``)."""
    tc = reduce.text_config(s.config)
    r = reduce.plan(s.config, [n for n, _, _ in s.tensors])
    was = {"layers": tc.get("num_hidden_layers"), "vocab": tc.get("vocab_size"),
           "experts": next((tc[k] for k in reduce.EXPERT_KEYS if isinstance(tc.get(k), int)), None)}
    config, tensors = reduce.apply(s.config, list(s.tensors), r)
    return StandIn(config, tuple(tensors), s.side_files, r.describe(was))


def write(standin: StandIn, folder: Path) -> dict[str, Path]:
    """``folder/plain`` (the trace's unquantized model), ``folder/modelopt`` and ``folder/compressed-tensors``
    (the builds under each output format's quantization config) and ``folder/weights.json`` (what is offered)."""
    dirs = {}
    for kind in ("plain", *QUANT_CONFIGS):
        d = folder / kind
        d.mkdir(parents=True, exist_ok=True)
        config = dict(standin.config)
        if kind != "plain":
            config["quantization_config"] = QUANT_CONFIGS[kind]
        (d / "config.json").write_text(json.dumps(config, indent=2))
        for rel, data in standin.side_files.items():
            (d / rel).write_bytes(data)
        dirs[kind] = d
    weights = folder / "weights.json"
    weights.write_text(json.dumps([[n, list(s), dt] for n, s, dt in standin.tensors]))
    dirs["weights"] = weights
    return dirs
