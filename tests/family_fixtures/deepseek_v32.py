"""A tiny DeepSeek V3.2 (``DeepseekV32ForCausalLM``) checkpoint: DeepSeek V3's layout (``tiny-deepseek-v3``:
FP8 e4m3 with 128x128 ``weight_scale_inv``, the MTP layer) plus the DSA lightning indexer in every layer's
attention, the MTP layer's included (docs/families.md, "DeepSeek V3.2"):

- ``self_attn.indexer.wq_b.weight`` FP8 [index_n_heads * index_head_dim, q_lora_rank] and ``wk.weight`` FP8
  [index_head_dim, hidden], each with its ``weight_scale_inv`` (SGLang's ``_load_fused_indexer_wk`` dequantizes a
  block-FP8 ``wk``; vLLM builds ``wq_b`` with the model's quant config);
- ``weights_proj.weight`` BF16 [index_n_heads, hidden], no bias (vLLM PR #26889), ``k_norm.weight`` / ``.bias``
  BF16 [index_head_dim] (a LayerNorm);
- config.json: DeepSeek V3's keys with ``architectures`` ``DeepseekV32ForCausalLM``, ``model_type``
  ``deepseek_v32`` and ``index_head_dim`` 128, ``index_n_heads``, ``index_topk`` 2048; ``kv_lora_rank`` the release's
  512 (``KV_LORA``).
"""

from __future__ import annotations

import json
from pathlib import Path

INDEX = {"index_head_dim": 128, "index_n_heads": 4, "index_topk": 2048}
#: The release's kv_lora_rank: vLLM's sparse MLA backends take only head size kv_lora + rope = 576 (FLASHMLA_SPARSE,
#: FLASHINFER_MLA_SPARSE), and FA4's sparse one an index_topk multiple of 128 (vLLM's selector, platforms/cuda.py)
KV_LORA = 512


def indexer_specs(cfg: dict, layer: int) -> list[tuple[str, str, tuple[int, ...]]]:
    pre, h, d, n = f"model.layers.{layer}.self_attn.indexer", cfg["hidden_size"], cfg["index_head_dim"], \
        cfg["index_n_heads"]
    return [(f"{pre}.wq_b.weight", "F8_E4M3", (n * d, cfg["q_lora_rank"])), (f"{pre}.wk.weight", "F8_E4M3", (d, h)),
            (f"{pre}.weights_proj.weight", "BF16", (n, h)), (f"{pre}.k_norm.weight", "BF16", (d,)),
            (f"{pre}.k_norm.bias", "BF16", (d,))]


def write(out: Path, seed: int = 0) -> Path:
    """``tiny-deepseek-v3`` written by the synth, then made V3.2: the config's keys, and each layer's indexer
    tensors added to the shard that holds its ``o_proj``."""

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kimi_convert.synth import find_preset, fp8_block, write_synth

    tests_presets = Path(__file__).resolve().parent.parent / "presets"
    write_synth(find_preset("tiny-deepseek-v3-kv512", [tests_presets]), out, seed=seed)  # kv_lora_rank KV_LORA
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", **INDEX)
    (out / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    g = torch.Generator().manual_seed(seed)
    for layer in range(cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]):
        fname = wm[f"model.layers.{layer}.self_attn.o_proj.weight"]
        with safe_open(str(out / fname), "pt") as h:
            data = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
        for name, dtype, shape in indexer_specs(cfg, layer):
            if dtype == "F8_E4M3":
                data[name], data[name.replace(".weight", ".weight_scale_inv")] = fp8_block(name, shape, seed)
            else:
                base = 1.0 if name.endswith("k_norm.weight") else 0.0
                data[name] = (base + 0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        save_file(data, str(out / fname), metadata={"format": "pt"})
        for k in data:
            wm[k] = fname
    index["metadata"]["total_size"] = sum(
        t.numel() * t.element_size() for f in sorted(set(wm.values()))
        for t in _all(out / f))
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def _all(path: Path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as h:
        for k in h.keys():  # noqa: SIM118
            yield h.get_tensor(k)


if __name__ == "__main__":
    import sys

    print(write(Path(sys.argv[1])))
