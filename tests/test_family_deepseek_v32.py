"""DeepSeek V3.2 (``DeepseekV32ForCausalLM``, preset ``tiny-deepseek-v3-2``): DeepSeek V3's layout plus the DSA
indexer; both engines build the indexer's ``wk`` and ``weights_proj`` as one unquantized BF16 layer, ``wq_b`` with the
model's quant config (docs/families.md, "DeepSeek V3.2")."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from helpers import run, write_synth


def test_indexer_kept_where_the_engines_build_it_unquantized(tmp_path: Path):
    src = write_synth("tiny-deepseek-v3-2", tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV32ForCausalLM"] and cfg["model_type"] == "deepseek_v32"
    assert (cfg["index_head_dim"], cfg["kv_lora_rank"], cfg["index_topk"]) == (128, 512, 2048)
    r = run("plan", src, "--json")
    assert r.code == 0, r.stderr
    kinds = {it["name"]: it["kind"] for it in json.loads(r.stdout)["modules"]}
    for layer in (0, 1, 2):  # the MTP layer (2) has its indexer too: kept whole, as SGLang's NextN draft builds it
        pre = f"model.layers.{layer}.self_attn.indexer"
        wq_b = "keep" if layer == 2 else "nvfp4"
        assert (kinds[f"{pre}.wk"], kinds[f"{pre}.weights_proj"], kinds[f"{pre}.wq_b"]) == ("keep", "keep", wq_b)
    r = run("pack", src, tmp_path / "out", "--device", "cpu")
    assert r.code == 0, r.stderr
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    wk = "model.layers.1.self_attn.indexer.wk.weight"
    with safe_open(str(tmp_path / "out" / index[wk]), "pt") as h:
        assert str(h.get_tensor(wk).dtype) == "torch.bfloat16"  # decoded from FP8 (SGLang's fused BF16 layer)
    assert f"{wk[:-len('weight')]}weight_scale_inv" not in index
    assert run("verify-manifest", tmp_path / "out", "--input", src).code == 0


def test_inspect_gives_benchmark_moe_values(tmp_path: Path):
    """V3.2 reads V3's keys (n_routed_experts, num_experts_per_tok, moe_intermediate_size): the DeepSeek branch of
    benchmark_moe.py, as for V3 (docs/families.md)."""
    r = run("inspect", write_synth("tiny-deepseek-v3-2", tmp_path / "src"))
    assert "E=8 topk=2 moe_intermediate_size=128 hidden_size=256" in r.stdout
    assert "MoE layers       1 [1]" in r.stdout
