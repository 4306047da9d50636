"""Synthetic checkpoints shaped like the real releases (names, shapes, dtypes, config, sharding).

The tiny presets are the built-in examples and test fixtures; the bench presets are a few GB with
real-size expert matrices. Values are deterministic for a seed (each tensor draws from its own
generator seeded by its name) with realistic spread: per-row scale variation and rare outliers.

Evidence for the K3 / Kimi Linear layout (engine files as pinned: vLLM 0.33.0 ``vllm/``, SGLang 0.5.23
``sglang/srt/``; "release" = moonshotai/Kimi-K3 config.json and its 497,220-tensor index, 96 shards):

config (text_config for K3, flat for Kimi Linear)
- linear_attn_config.use_full_rank_gate / gate_lower_bound -5.0 sit INSIDE linear_attn_config:
  vLLM models/kimi_k3/nvidia/model.py:720 and :1247-1271 (kda_config.get), kda.py:618,625;
  SGLang models/kimi_k3.py:1547 and :3129-3131. kda_layers/full_attn_layers are 1-based and asserted
  (both configs/kimi_linear.py: vLLM :118-120, SGLang :119-121). Release pattern: MLA at 4, 8, ... and
  the last layer (K3 4..92 + 93, Kimi-Linear-48B 4..24 + 27); kinds() follows it.
- mla_use_nope: vLLM model.py:744 asserts it (MLA is NoPE-only, K3 and Kimi Linear alike).
- mla_use_output_gate: vLLM model.py:753 (use_output_gate) -> mla.py:220 fused_qkv_a_g_proj /
  :277 g_proj; SGLang kimi_k3.py:2175, :2273 g_proj. Default False in both configs.
- attn_res_block_size: vLLM model.py:796-821 (per-layer res tensors), :1003-1015 (output_attn_res_*);
  SGLang kimi_k3.py:2588 (per layer), :2771-2778 (output_attn_res_*). Unset -> no res tensors built.
- latent_moe_use_norm: vLLM model.py:390,484; SGLang kimi_k3.py:672. Unset -> no routed_expert_norm.
- routed_expert_hidden_size: vLLM model.py:385-389 (use_latent_moe), SGLang kimi_k3.py:427-431.
- hidden_act "situ" + activation_situ_beta/linear_beta (K3 release); SGLang kimi_linear.py:98 needs
  "silu" for Kimi Linear. num_experts / num_experts_per_token / topk_method noaux_tc (SGLang's
  MoEGate builds e_score_correction_bias only for noaux_tc, deepseek_v2.py:518).
- vision_config: KimiK3VisionConfig (vLLM transformers_utils/configs/kimi_k3.py:13-83, SGLang
  configs/kimi_k3.py:6-76, identical) with the release's vt_* / qkv_hidden_size / rmsnorm / no-bias /
  patchmergerv2 values. The release keeps the compressed-tensors quantization_config in text_config only
  (KimiK3Config copies it up: vLLM kimi_k3.py:128, SGLang :113).

tensor names (checkpoint names; the engines' own renames in brackets)
- KDA (K3): q/k/v/g_proj [P,H] [vLLM in_proj_qkvgfab shards 0-3 model.py:1259-1271; SGLang
  fused_qkvg_proj kimi_k3.py:3135-3140], f_a_proj, b_proj [vLLM in_proj shards 4/5; SGLang separate],
  f_b_proj, q/k/v_conv1d [P,1,K] fp32 [vLLM conv1d; SGLang qkv_conv1d :1723], A_log [head_dim] fp32 zero
  past num_heads (vLLM kda.py:83-103 narrows 1-D or 4-D; SGLang kimi_k3.py:1733-1756 "Checkpoint stores
  A_log as [head_dim]"), dt_bias [P] fp32, o_norm [hd] fp32 (release), o_proj.
- KDA (Kimi Linear): g_a_proj/g_b_proj (vLLM layers/mamba/gdn/kimi_gdn_linear_attn.py:289-303, SGLang
  kimi_linear.py:369-383), A_log [1,1,heads,1]: SGLang's loader shards dim 2 (kimi_linear.py:410-415),
  so only the 4-D form loads there; vLLM takes either (kimi_gdn_linear_attn.py:47-67).
- MLA (K3): q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj,
  g_proj [heads*v_head, H] [vLLM fused_qkv_a_g_proj model.py:1273-1277; SGLang fused_qkv_a_proj_with_mqa
  kimi_k3.py:3213 + g_proj]. Kimi Linear: q_proj, no gate (vLLM mla.py:263, SGLang deepseek_v2.py:2087).
- MoE: block_sparse_moe.gate.weight, gate.e_score_correction_bias fp32, shared_experts.*, latent
  routed_expert_down_proj [Hx,H] / routed_expert_norm [Hx] / routed_expert_up_proj [H,Hx], experts.{e}.
  w1/w3 [I,Hx] w2 [Hx,I] as weight_packed + weight_scale (vLLM model.py:343-360, 1320-1325; SGLang
  kimi_k3.py:3209 renames weight_packed; SGLang maps block_sparse_moe -> mlp, :3481).
- attention residuals: layers.N.{self_attention,mlp}_res_{norm,proj} ([1,H] proj) and
  model.output_attn_res_{norm,proj} (release shard 94, next to model.norm).
- vision (K3): vision_tower.patch_embed.proj.weight [vt,3,14,14] (no bias), patch_embed.pos_emb.weight
  [init_pos_emb_height, init_pos_emb_width, vt], encoder.blocks.j.{norm0,norm1} (RMSNorm, weight only),
  wqkv [3*qkv_hidden, vt], wo [vt, qkv_hidden], mlp.fc0 [vt_inter, vt], mlp.fc1 (no biases),
  encoder.final_layernorm; mm_projector.proj.0 [4vt,4vt], proj.2 [H,4vt], post_norm [H], no pre_norm:
  vLLM model_executor/models/kimi_k25_vit.py:141,213-218,401-430,563,910-927 (proj.0/2 ->
  linear_1/linear_2 by the WeightsMapper, model.py:1584-1590); SGLang models/kimi_k3_vl.py:198,267-273,
  372-373,411-415,558,871-893.

engines disagree (the release's names are used)
- unknown names: vLLM raises (params_dict KeyError / AutoWeightsLoader); SGLang skips them silently
  (kimi_k3.py text loader) or warns "Unmapped vision weight" (kimi_k3.py:3852-3856).
- Kimi Linear A_log: 4-D only in SGLang, 1-D or 4-D in vLLM.
- latent routed_expert_{down,up}_proj: SGLang builds them with quant_config=None (kimi_k3.py:651-663);
  vLLM 0.33 passes the model's quant_config (model.py:477-499), so a quantized checkpoint must name
  them in its exclude list for vLLM to build them BF16.
- vision projector: vLLM renames proj.0/proj.2 to linear_1/linear_2; SGLang keeps nn.Sequential names.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from kimi_convert.kernels.reference import e2m1_codes, pack

from . import synth_deepseek, synth_glm, synth_gptoss, synth_gqa, synth_minimax, synth_qwen35
from .checkpoint import INDEX_NAME
from .errors import ConvertError
from .safetensors_format import HeaderTensor, encode_header
from .synth_deepseek import ARCHES as DEEPSEEK_ARCHES
from .synth_gptoss import ARCHES as GPTOSS_ARCHES
from .write import default_mode


@dataclass(frozen=True)
class Preset:
    arch: str  # "kimi_k3", "kimi_linear" or "deepseek_v3"
    hidden: int
    layers: int
    kda_heads: int
    kda_head_dim: int
    conv: int
    mla_heads: int
    q_lora: int  # 0: plain q_proj (Kimi Linear)
    kv_lora: int
    nope: int
    rope: int
    v_head: int
    experts: int
    topk: int
    moe_inter: int
    latent: int  # routed_expert_hidden_size (== hidden: no latent projections)
    shared: int
    dense_inter: int
    first_dense: int
    vocab: int
    vision_hidden: int = 0  # vt_hidden_size (== mm_hidden_size)
    vision_blocks: int = 0  # vt_num_hidden_layers
    vision_heads: int = 0  # vt_num_attention_heads
    vision_qkv: int = 0  # qkv_hidden_size (attention width, != vt_hidden_size in K3)
    vision_inter: int = 0  # vt_intermediate_size
    vision_pos: int = 0  # init_pos_emb_height == init_pos_emb_width
    attn_res_block: int = 0  # attn_res_block_size (0: no attention residuals)
    mxfp4_experts: bool = False
    full_rank_gate: bool = False
    fp8: bool = False  # DeepSeek-style FP8 weights with 128x128 weight_scale_inv
    shards: int = 4
    description: str = ""
    sparse: bool = False  # headers real, data regions holes (write_sparse): for plan/manifest tests at scale
    cut_by_bytes: bool = False  # shards of equal bytes (many shards of experts), not cuts snapped onto k_proj/up_proj
    # GQA attention (synth_gqa: Qwen3 MoE, GLM-4.5): query heads, key/value heads, head_dim
    attn_heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = False  # q_norm / k_norm [head_dim] (Qwen3 MoE; GLM-4.5 with use_qk_norm)
    attn_bias: bool = False  # q/k/v biases (GLM-4.5: attention_bias true)
    nextn: int = 0  # num_nextn_predict_layers: MTP layers stored after the last layer (GLM-4.5)
    # Qwen3.5 MoE (synth_qwen35): Gated DeltaNet key heads (value heads: kda_heads, head dim: kda_head_dim)
    linear_k_heads: int = 0
    # DeepSeek V3.2-style sparse-attention indexer (synth_glm: GLM-5.x): heads, head dim, and the top-k
    # sharing period index_topk_freq (1: every layer has its own indexer, GLM-5 / 5.1; 4: GLM-5.2)
    index_heads: int = 0
    index_head_dim: int = 0
    index_freq: int = 1

    def kinds(self) -> list[str]:
        """The releases' pattern: every fourth layer (1-based 4, 8, ...) and the last are MLA (full
        attention), the others KDA (Kimi-K3: full_attn_layers 4..92 and 93; Kimi-Linear-48B: 4..24 and
        27); DeepSeek: all MLA."""
        if self.arch == "deepseek_v3" or self.arch in DEEPSEEK_ARCHES:
            return ["mla"] * self.layers
        return ["mla" if (i + 1) % 4 == 0 or i == self.layers - 1 else "kda" for i in range(self.layers)]


# tiny-k3 keeps the release's ratios where an engine or the nvidia-k3 recipe checks them: KDA head_dim 128
# (A_log [head_dim] covers the heads; f_b_proj's K is head_dim), and every module the recipe stores as
# 128x128 block FP8 has K a multiple of 128 (f_b_proj 128, q_b_proj q_lora 128, kv_b_proj kv_lora 128,
# o_proj heads*v_head 256), as vLLM's validate_fp8_block_shape asks
# (model_executor/layers/quantization/utils/fp8_utils.py:1319-1330); MLA heads == KDA heads, as released.
# Both Kimi presets keep the release's MLA head dims (nope 128, rope 64, v 128): vLLM's MLA prefill
# backend selection accepts no other (v1/attention/backends/mla/prefill/flash_attn.py:313-330).
PRESETS: dict[str, Preset] = {
    # moe_inter 128 / latent 256 (< hidden 384, as the release's 3584 < 7168): the engines' MXFP4 MoE
    # backends pad smaller expert sizes (vLLM's TRTLLM backend to 128/256, SGLang's _load_w13 refuses 64),
    # so below these the engines cannot load the input.
    "tiny-k3": Preset(
        "kimi_k3", hidden=384, layers=4, kda_heads=2, kda_head_dim=128, conv=4, mla_heads=2, q_lora=128,
        kv_lora=128, nope=128, rope=64, v_head=128, experts=8, topk=2, moe_inter=128, latent=256, shared=1,
        dense_inter=256, first_dense=1, vocab=1000, vision_hidden=64, vision_blocks=2, vision_heads=2,
        vision_qkv=128, vision_inter=128, vision_pos=8, attn_res_block=2, mxfp4_experts=True,
        full_rank_gate=True, description="Kimi K3 layout, hidden 384, 4 layers, 8 MXFP4 experts (~10 MB)",
    ),
    # moe_inter 128: vLLM's BF16 MoE pads a smaller intermediate size (its w13 padding stays unloaded).
    "tiny-kimi-linear": Preset(
        "kimi_linear", hidden=128, layers=4, kda_heads=4, kda_head_dim=32, conv=4, mla_heads=4, q_lora=0,
        kv_lora=32, nope=128, rope=64, v_head=128, experts=8, topk=2, moe_inter=128, latent=128, shared=1,
        dense_inter=256, first_dense=1, vocab=1000, description="Kimi Linear layout, hidden 128, 4 layers (~4 MB)",
    ),
    "tiny-deepseek-fp8": Preset(
        "deepseek_v3", hidden=256, layers=3, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=4, q_lora=96,
        kv_lora=64, nope=32, rope=32, v_head=32, experts=4, topk=2, moe_inter=128, latent=256, shared=1,
        dense_inter=384, first_dense=1, vocab=1000, fp8=True,
        description="DeepSeek V3 layout, FP8 weights with 128x128 block scales, hidden 256 (~2 MB)",
    ),
    # DeepSeek V3 / R1 and Kimi K2 as released (convert/synth_deepseek.py, docs/families.md): FP8 e4m3 with
    # 128x128 weight_scale_inv, a dense first layer, one shared expert, noaux_tc router, MTP layer (DeepSeek).
    # MLA head dims as released (nope 128, rope 64, v 128); q_lora / kv_lora / moe_inter multiples of 128
    # (vLLM's validate_fp8_block_shape: every merged member but the last a multiple of block_n).
    "tiny-deepseek-v3": Preset(
        "deepseek_v3_release", hidden=256, layers=2, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=2,
        q_lora=128, kv_lora=128, nope=128, rope=64, v_head=128, experts=8, topk=2, moe_inter=128, latent=256,
        shared=1, dense_inter=256, first_dense=1, vocab=1000, fp8=True, nextn=1, shards=3,
        description="DeepSeek V3 / R1 layout: FP8 128x128 blocks, hidden 256, 1 dense + 1 MoE layer + the MTP "
                    "layer, 8 experts",
    ),
    "tiny-kimi-k2": Preset(
        "kimi_k2", hidden=256, layers=2, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=2,
        q_lora=128, kv_lora=128, nope=128, rope=64, v_head=128, experts=8, topk=2, moe_inter=128, latent=256,
        shared=1, dense_inter=256, first_dense=1, vocab=1000, fp8=True, shards=3,
        description="Kimi K2 layout (model_type kimi_k2): FP8 128x128 blocks, hidden 256, 1 dense + 1 MoE layer, "
                    "8 experts",
    ),
    # DeepSeek-V3's width (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, experts of 2048) in 2 layers
    # (dense layer 0 with intermediate 18432, one MoE layer of 16 experts) without the MTP layer.
    "bench-deepseek-v3": Preset(
        "deepseek_v3_release", hidden=7168, layers=2, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=128,
        q_lora=1536, kv_lora=512, nope=128, rope=64, v_head=128, experts=16, topk=8, moe_inter=2048,
        latent=7168, shared=1, dense_inter=18432, first_dense=1, vocab=8192, fp8=True, shards=4,
        description="DeepSeek-V3 at real width: FP8, dense layer 0 and one MoE layer of 16 experts 2048 x 7168",
    ),
    "bench-kimi-linear": Preset(
        "kimi_linear", hidden=7168, layers=2, kda_heads=32, kda_head_dim=128, conv=4, mla_heads=32, q_lora=0,
        kv_lora=512, nope=128, rope=64, v_head=128, experts=6, topk=2, moe_inter=3072, latent=7168, shared=1,
        dense_inter=18432, first_dense=0, vocab=8192, shards=4,
        description="Kimi Linear layout at K3 width: bf16 experts 3072 x 7168, one KDA + one MLA layer",
    ),
    "bench-k3": Preset(
        "kimi_k3", hidden=7168, layers=2, kda_heads=32, kda_head_dim=128, conv=4, mla_heads=32, q_lora=1536,
        kv_lora=512, nope=128, rope=64, v_head=128, experts=32, topk=8, moe_inter=3072, latent=3584, shared=2,
        dense_inter=18432, first_dense=0, vocab=8192, vision_hidden=256, vision_blocks=1, vision_heads=4,
        vision_qkv=384, vision_inter=1024, vision_pos=16, attn_res_block=12, mxfp4_experts=True,
        full_rank_gate=True, shards=4,
        description="Kimi K3 at real width: MXFP4 experts 3072 x 3584, latent MoE, one KDA + one MLA layer",
    ),
    # bench-k3 with 3x the experts (70% of the bytes are experts, the release's 97%), cut by bytes into
    # 24 shards of ~200 MB: a converter that works shard by shard (NVIDIA's, --jobs N) has shards to spread
    # over its workers. 4.8 GB: NVIDIA's converter takes a few minutes on 2 cores (--layers 4: 9.5 GB).
    "bench-k3-shards": Preset(
        "kimi_k3", hidden=7168, layers=2, kda_heads=32, kda_head_dim=128, conv=4, mla_heads=32, q_lora=1536,
        kv_lora=512, nope=128, rope=64, v_head=128, experts=96, topk=8, moe_inter=3072, latent=3584, shared=2,
        dense_inter=18432, first_dense=0, vocab=8192, vision_hidden=256, vision_blocks=1, vision_heads=4,
        vision_qkv=384, vision_inter=1024, vision_pos=16, attn_res_block=12, mxfp4_experts=True,
        full_rank_gate=True, shards=24, cut_by_bytes=True,
        description="Kimi K3 at real width in 24 shards of equal bytes: one KDA + one MLA layer, 96 MXFP4 "
                    "experts 3072 x 3584 a layer",
    ),
    # Qwen3 MoE (Qwen/Qwen3-30B-A3B's config at reduced sizes; docs/families.md): head_dim 128 as released
    # (the engines' attention backends take it), moe_inter 128 (vLLM's BF16 MoE pads a smaller one).
    "tiny-qwen3-moe": Preset(
        "qwen3_moe", hidden=256, layers=2, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=0, q_lora=0, kv_lora=0,
        nope=0, rope=0, v_head=0, experts=8, topk=2, moe_inter=128, latent=256, shared=0, dense_inter=768,
        first_dense=0, vocab=1000, attn_heads=4, kv_heads=2, head_dim=128, qk_norm=True,
        description="Qwen3 MoE layout (Qwen3-30B-A3B), hidden 256, 2 layers, 8 bf16 experts (~6 MB)",
    ),
    # Qwen3-30B-A3B's width (hidden 2048, 32 x 128 query heads, 4 KV heads, 128 experts of 768) in 2 layers.
    "bench-qwen3-moe": Preset(
        "qwen3_moe", hidden=2048, layers=2, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=0, q_lora=0,
        kv_lora=0, nope=0, rope=0, v_head=0, experts=128, topk=8, moe_inter=768, latent=2048, shared=0,
        dense_inter=6144, first_dense=0, vocab=8192, attn_heads=32, kv_heads=4, head_dim=128, qk_norm=True,
        shards=4, description="Qwen3-30B-A3B at real width: 128 bf16 experts 768 x 2048 a layer, 2 layers",
    ),
    # GLM-4.5 (zai-org/GLM-4.5's config at reduced sizes): qkv bias, qk-norm, a dense first layer, one shared
    # expert, fp32 e_score_correction_bias and the MTP layer (num_nextn_predict_layers 1) as released.
    "tiny-glm4-moe": Preset(
        "glm4_moe", hidden=256, layers=3, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=0, q_lora=0, kv_lora=0,
        nope=0, rope=0, v_head=0, experts=8, topk=2, moe_inter=128, latent=256, shared=1, dense_inter=768,
        first_dense=1, vocab=1000, attn_heads=4, kv_heads=2, head_dim=128, qk_norm=True, attn_bias=True, nextn=1,
        description="GLM-4.5 layout, hidden 256, 3 layers (1 dense) + the MTP layer, 8 bf16 experts (~11 MB)",
    ),
    # GLM-4.5-Air's width (hidden 4096, 96 x 128 query heads, 8 KV heads, experts of 1408, 1 shared) in 2
    # layers (dense layer 0 and one MoE layer) plus its MTP layer; 64 of the release's 128 experts a layer
    # (5.6 GB; two MoE layers of 128 would take 10 GB).
    "bench-glm4-moe": Preset(
        "glm4_moe", hidden=4096, layers=2, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=0, q_lora=0,
        kv_lora=0, nope=0, rope=0, v_head=0, experts=64, topk=8, moe_inter=1408, latent=4096, shared=1,
        dense_inter=10944, first_dense=1, vocab=8192, attn_heads=96, kv_heads=8, head_dim=128, qk_norm=False,
        attn_bias=True, nextn=1, shards=8,
        description="GLM-4.5-Air at real width: dense layer 0, one MoE layer + the MTP layer, 64 bf16 "
                    "experts 1408 x 4096 a layer",
    ),
    # Qwen3.5 MoE (synth_qwen35): 4 layers, the release's layer_types rule (three Gated DeltaNet, one gated
    # full attention), the release's head_dim 256 and DeltaNet head dim 128, a 1-block vision tower, MTP.
    "tiny-qwen3-5-moe": Preset(
        "qwen3_5_moe", hidden=256, layers=4, kda_heads=4, kda_head_dim=128, conv=4, mla_heads=0, q_lora=0,
        kv_lora=0, nope=0, rope=0, v_head=0, experts=8, topk=2, moe_inter=128, latent=256, shared=1,
        dense_inter=128, first_dense=0, vocab=1000, attn_heads=2, kv_heads=1, head_dim=256, nextn=1,
        linear_k_heads=2, vision_hidden=128, vision_blocks=1, vision_heads=2, vision_inter=256, vision_pos=64,
        description="Qwen3.5 MoE layout, hidden 256, 3 DeltaNet + 1 full-attention layer, 8 experts, vision, MTP",
    ),
    "bench-qwen3-5-moe": Preset(
        "qwen3_5_moe", hidden=2048, layers=4, kda_heads=32, kda_head_dim=128, conv=4, mla_heads=0, q_lora=0,
        kv_lora=0, nope=0, rope=0, v_head=0, experts=64, topk=8, moe_inter=512, latent=2048, shared=1,
        dense_inter=512, first_dense=0, vocab=8192, attn_heads=16, kv_heads=2, head_dim=256, nextn=0,
        linear_k_heads=16, vision_hidden=256, vision_blocks=1, vision_heads=4, vision_inter=1024, vision_pos=64,
        shards=8,
        description="Qwen3.5-35B-A3B's width: 3 DeltaNet + 1 full-attention layer, 64 of its 256 bf16 experts "
                    "512 x 2048 a layer",
    ),
    # GLM-5.x (synth_glm; zai-org/GLM-5.1's config with GLM-5.2's index sharing, docs/families.md): MLA head
    # dims and kv_lora 512 as released, the DSA indexer (index_head_dim 128) on layers 0-2 and the MTP layer,
    # layer 3 reusing layer 2's top-k (index_topk_freq 4, offset 3), a dense layer 0, one shared expert.
    "tiny-glm5": Preset(
        "glm_moe_dsa", hidden=256, layers=4, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=2, q_lora=128,
        kv_lora=512, nope=192, rope=64, v_head=256, experts=8, topk=2, moe_inter=128, latent=256, shared=1,
        dense_inter=256, first_dense=1, vocab=1000, nextn=1, index_heads=4, index_head_dim=128, index_freq=4,
        shards=3,
        description="GLM-5.x layout (GLM-5.2's index sharing): MLA + DSA indexer, hidden 256, 1 dense + 3 MoE "
                    "layers + the MTP layer, 8 bf16 experts",
    ),
    # GLM-5.2-FP8 (zai-org/GLM-5.2-FP8): tiny-glm5 with DeepSeek-style 128x128 block FP8 linear weights (the router
    # and the indexer's weights_proj BF16), the eh_proj and the MTP layer FP8 as well.
    "tiny-glm5-fp8": Preset(
        "glm_moe_dsa", hidden=256, layers=4, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=2, q_lora=128,
        kv_lora=512, nope=192, rope=64, v_head=256, experts=8, topk=2, moe_inter=128, latent=256, shared=1,
        dense_inter=256, first_dense=1, vocab=1000, nextn=1, index_heads=4, index_head_dim=128, index_freq=4,
        fp8=True, shards=3,
        description="GLM-5.2-FP8 layout: tiny-glm5 with 128x128 block FP8 linear weights",
    ),
    # GLM-4.7-Flash (zai-org/GLM-4.7-Flash's config at reduced sizes): MLA as GLM-5 without the indexer.
    "tiny-glm4-moe-lite": Preset(
        "glm4_moe_lite", hidden=256, layers=2, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=2, q_lora=128,
        kv_lora=512, nope=192, rope=64, v_head=256, experts=8, topk=2, moe_inter=128, latent=256, shared=1,
        dense_inter=256, first_dense=1, vocab=1000, nextn=1, shards=3,
        description="GLM-4.7-Flash layout: MLA, hidden 256, 1 dense + 1 MoE layer + the MTP layer, 8 bf16 experts",
    ),
    # gpt-oss (openai/gpt-oss-20b's config at reduced sizes; docs/families.md "gpt-oss"): MXFP4 expert banks
    # [E, 2I, H/32, 16] with gate/up interleaved, biases everywhere, attention sinks; head_dim 64 as
    # released. hidden = intermediate 256: the engines' MXFP4 MoE backends pad smaller sizes.
    "tiny-gpt-oss": Preset(
        "gpt_oss", hidden=256, layers=2, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=0, q_lora=0, kv_lora=0,
        nope=0, rope=0, v_head=0, experts=4, topk=2, moe_inter=256, latent=256, shared=0, dense_inter=0,
        first_dense=0, vocab=1000, attn_heads=4, kv_heads=2, head_dim=64, shards=2,
        description="gpt-oss layout (gpt-oss-20b), hidden 256, 2 layers, 4 MXFP4 experts (~3 MB)",
    ),
    # gpt-oss-20b's width (hidden = intermediate 2880, 64 x 64 query heads, 8 KV heads, 32 experts) in 2 layers.
    "bench-gpt-oss": Preset(
        "gpt_oss", hidden=2880, layers=2, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=0, q_lora=0,
        kv_lora=0, nope=0, rope=0, v_head=0, experts=32, topk=4, moe_inter=2880, latent=2880, shared=0,
        dense_inter=0, first_dense=0, vocab=8192, attn_heads=64, kv_heads=8, head_dim=64, shards=2,
        description="gpt-oss-20b at real width: 32 MXFP4 experts 2880 x 2880 (gate/up 5760) a layer, 2 layers",
    ),
    # The released K3 at full size: 497,220 tensors in 96 shards, 1.56 TB apparent size, a few hundred MB
    # of real disk (headers and index only; every data region is a hole and reads as zeros, which are
    # valid MXFP4 and BF16). From docs/kimi-k3.md: hidden 7168, 93 layers (69 KDA + 24 MLA), KDA 96 x 128,
    # q_lora 1536, kv_lora 512, 896 experts, top-16, 2 shared, moe_intermediate 3072, latent 3584. Not in
    # the docs, taken where the tensor count (497,220 = 92 MoE layers x 5,376 expert tensors + 2,628)
    # and the 1.56 TB pin them: 27 vision blocks and the vision tower's other sizes (SGLang 0.5.23's
    # KimiK3VisionConfig defaults: vt 1024, qkv 1536, 12 heads, intermediate 4096, pos 64x64), MLA heads
    # 96, vocab 163840, dense layer 0 intermediate 33792, attn_res_block_size 12.
    "k3-full-sparse": Preset(
        "kimi_k3", hidden=7168, layers=93, kda_heads=96, kda_head_dim=128, conv=4, mla_heads=96, q_lora=1536,
        kv_lora=512, nope=128, rope=64, v_head=128, experts=896, topk=16, moe_inter=3072, latent=3584, shared=2,
        dense_inter=33792, first_dense=1, vocab=163840, vision_hidden=1024, vision_blocks=27, vision_heads=12,
        vision_qkv=1536, vision_inter=4096, vision_pos=64, attn_res_block=12, mxfp4_experts=True,
        full_rank_gate=True, shards=96, sparse=True,
        description="the released Kimi K3's layout at full size (497,220 tensors, 96 shards, 1.56 TB) as a "
                    "sparse file set: real headers, data regions are holes (zeros)",
    ),
    # MiniMax-M2 (MiniMaxAI/MiniMax-M2's config at reduced sizes; docs/families.md): FP8 128x128 block source,
    # head_dim 128 and rotary_dim 64 as released, 48/8 heads shrunk to 4/2, experts of 256 (K a multiple
    # of 128 for every FP8 weight, as vLLM's validate_fp8_block_shape asks).
    "tiny-minimax-m2": Preset(
        "minimax_m2", hidden=256, layers=2, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=0, q_lora=0,
        kv_lora=0, nope=0, rope=0, v_head=0, experts=8, topk=2, moe_inter=256, latent=256, shared=0,
        dense_inter=0, first_dense=0, vocab=1000, attn_heads=4, kv_heads=2, head_dim=128, qk_norm=True,
        fp8=True, description="MiniMax-M2 layout, FP8 128x128 block weights, hidden 256, 2 layers, 8 experts (~5 MB)",
    ),
    # MiniMax-M2's width (hidden 3072, 48 x 128 query heads, 8 KV heads, experts of 1536, top-8) in 2 layers
    # of 64 of its 256 experts.
    "bench-minimax-m2": Preset(
        "minimax_m2", hidden=3072, layers=2, kda_heads=0, kda_head_dim=0, conv=0, mla_heads=0, q_lora=0,
        kv_lora=0, nope=0, rope=0, v_head=0, experts=64, topk=8, moe_inter=1536, latent=3072, shared=0,
        dense_inter=0, first_dense=0, vocab=8192, attn_heads=48, kv_heads=8, head_dim=128, qk_norm=True,
        fp8=True, shards=4,
        description="MiniMax-M2 at real width: FP8 block experts 1536 x 3072, 64 a layer, 2 layers",
    ),
}


def _gen(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def weight(name: str, shape: tuple[int, ...], seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Gaussian rows of varying scale (log-normal), std ~ 1/sqrt(fan-in), and rare outliers."""
    g = _gen(seed, name)
    fan_in = shape[-1] if len(shape) > 1 else 1
    w = torch.randn(shape, generator=g, dtype=torch.float32)
    if len(shape) >= 2:
        rows = torch.exp(0.5 * torch.randn((*shape[:-1], 1), generator=g))
        w.mul_(rows / math.sqrt(fan_in))
        n_out = max(1, w.numel() // 20000)
        idx = torch.randint(0, w.numel(), (n_out,), generator=g)
        w.view(-1)[idx] *= 8 + 24 * torch.rand(n_out, generator=g)
    else:
        w.mul_(0.05).add_(1.0 if name.endswith(("norm.weight", "norm0.weight", "norm1.weight")) else 0.0)
    return w.to(dtype)


def mxfp4(name: str, shape: tuple[int, int], seed: int, wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 tensor (packed codes, E8M0 scales) quantized from a realistic weight.

    ``wide`` scales a few blocks down by 2^-24 so the exponents span more than e4m3 can hold
    around one global scale (the case exact transcoding must refuse).
    """
    w = weight(name, shape, seed, torch.float32)
    n, k = shape
    blocks = w.view(n, k // 32, 32)
    if wide:
        blocks[0, 0].mul_(2.0**-24)
    amax = blocks.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    x = blocks / torch.exp2(exp).unsqueeze(-1)
    codes = e2m1_codes(x.reshape(n, k))
    return pack(codes), (exp + 127).to(torch.uint8)


def _kda(p: Preset, pre: str) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    h, hd, heads = p.hidden, p.kda_head_dim, p.kda_heads
    P = heads * hd
    for x in ("q", "k", "v"):
        yield f"{pre}.{x}_proj.weight", (P, h), torch.bfloat16
        yield f"{pre}.{x}_conv1d.weight", (P, 1, p.conv), torch.float32
    yield f"{pre}.f_a_proj.weight", (hd, h), torch.bfloat16
    yield f"{pre}.f_b_proj.weight", (P, hd), torch.bfloat16
    if p.full_rank_gate:
        yield f"{pre}.g_proj.weight", (P, h), torch.bfloat16
        yield f"{pre}.A_log", (hd,), torch.float32  # [head_dim], zero past num_heads (needs hd >= heads)
    else:
        yield f"{pre}.g_a_proj.weight", (hd, h), torch.bfloat16
        yield f"{pre}.g_b_proj.weight", (P, hd), torch.bfloat16
        yield f"{pre}.A_log", (1, 1, heads, 1), torch.float32
    yield f"{pre}.b_proj.weight", (heads, h), torch.bfloat16
    yield f"{pre}.dt_bias", (P,), torch.float32
    yield f"{pre}.o_norm.weight", (hd,), (torch.float32 if p.arch == "kimi_k3" else torch.bfloat16)
    yield f"{pre}.o_proj.weight", (h, P), torch.bfloat16


def _mla(p: Preset, pre: str) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    h, nh = p.hidden, p.mla_heads
    qk = p.nope + p.rope
    if p.q_lora:
        yield f"{pre}.q_a_proj.weight", (p.q_lora, h), torch.bfloat16
        yield f"{pre}.q_a_layernorm.weight", (p.q_lora,), torch.bfloat16
        yield f"{pre}.q_b_proj.weight", (nh * qk, p.q_lora), torch.bfloat16
    else:
        yield f"{pre}.q_proj.weight", (nh * qk, h), torch.bfloat16
    yield f"{pre}.kv_a_proj_with_mqa.weight", (p.kv_lora + p.rope, h), torch.bfloat16
    yield f"{pre}.kv_a_layernorm.weight", (p.kv_lora,), torch.bfloat16
    yield f"{pre}.kv_b_proj.weight", (nh * (p.nope + p.v_head), p.kv_lora), torch.bfloat16
    yield f"{pre}.o_proj.weight", (h, nh * p.v_head), torch.bfloat16
    if p.arch == "kimi_k3":
        yield f"{pre}.g_proj.weight", (nh * p.v_head, h), torch.bfloat16


def _mlp(pre: str, h: int, inter: int) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    yield f"{pre}.gate_proj.weight", (inter, h), torch.bfloat16
    yield f"{pre}.up_proj.weight", (inter, h), torch.bfloat16
    yield f"{pre}.down_proj.weight", (h, inter), torch.bfloat16


def _moe(p: Preset, pre: str) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    h, hx, e = p.hidden, p.latent, p.experts
    yield f"{pre}.gate.weight", (e, h), torch.bfloat16
    yield f"{pre}.gate.e_score_correction_bias", (e,), torch.float32
    yield from _mlp(f"{pre}.shared_experts", h, p.moe_inter * p.shared)
    if hx != h:  # latent MoE (routed_expert_hidden_size); the norm with latent_moe_use_norm, set for K3
        yield f"{pre}.routed_expert_down_proj.weight", (hx, h), torch.bfloat16
        yield f"{pre}.routed_expert_norm.weight", (hx,), torch.bfloat16
        yield f"{pre}.routed_expert_up_proj.weight", (h, hx), torch.bfloat16
    for i in range(e):
        for w, shape in (("w1", (p.moe_inter, hx)), ("w2", (hx, p.moe_inter)), ("w3", (p.moe_inter, hx))):
            yield f"{pre}.experts.{i}.{w}.weight", shape, (torch.uint8 if p.mxfp4_experts else torch.bfloat16)


# The families laid out by their own module (each names its ARCHES and gives tensor_specs, config and
# SIDE_FILES): adding a family adds a module here, not another branch in each function below.
FAMILY_MODULES = (synth_deepseek, synth_glm, synth_gptoss, synth_gqa, synth_minimax, synth_qwen35)


def _family_module(p: Preset):
    """The family module that lays out `p`, or None for the families this module lays out itself."""
    return next((m for m in FAMILY_MODULES if p.arch in m.ARCHES), None)


def tensor_specs(p: Preset) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every stored tensor: name, logical shape, dtype (uint8 marks an MXFP4 weight, float8 an FP8
    block-scaled one)."""
    family = _family_module(p)
    if family is not None:
        yield from family.tensor_specs(p)
        return
    if p.arch == "deepseek_v3":
        yield from _deepseek(p)
        return
    lm = "language_model." if p.arch == "kimi_k3" else ""
    h = p.hidden
    yield f"{lm}model.embed_tokens.weight", (p.vocab, h), torch.bfloat16
    for i, kind in enumerate(p.kinds()):
        pre = f"{lm}model.layers.{i}"
        yield f"{pre}.input_layernorm.weight", (h,), torch.bfloat16
        yield f"{pre}.post_attention_layernorm.weight", (h,), torch.bfloat16
        yield from (_kda(p, f"{pre}.self_attn") if kind == "kda" else _mla(p, f"{pre}.self_attn"))
        if i < p.first_dense:
            yield from _mlp(f"{pre}.mlp", h, p.dense_inter)
        else:
            yield from _moe(p, f"{pre}.block_sparse_moe")
        if p.attn_res_block:
            for r in ("self_attention", "mlp"):
                yield f"{pre}.{r}_res_norm.weight", (h,), torch.bfloat16
                yield f"{pre}.{r}_res_proj.weight", (1, h), torch.bfloat16
    yield f"{lm}model.norm.weight", (h,), torch.bfloat16
    if p.attn_res_block:
        yield f"{lm}model.output_attn_res_norm.weight", (h,), torch.bfloat16
        yield f"{lm}model.output_attn_res_proj.weight", (1, h), torch.bfloat16
    yield f"{lm}lm_head.weight", (p.vocab, h), torch.bfloat16
    if p.vision_blocks:
        yield from _vision(p)


def _vision(p: Preset) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """K3's MoonViT3d tower (rmsnorm, no biases, qkv width qkv_hidden_size) and its patchmergerv2
    projector (no pre-norm, bias-free proj.0/proj.2, post_norm)."""
    vh, qkv, merged = p.vision_hidden, p.vision_qkv, 4 * p.vision_hidden  # merge_kernel_size [2, 2]
    yield "mm_projector.proj.0.weight", (merged, merged), torch.bfloat16
    yield "mm_projector.proj.2.weight", (p.hidden, merged), torch.bfloat16
    yield "mm_projector.post_norm.weight", (p.hidden,), torch.bfloat16
    yield "vision_tower.patch_embed.proj.weight", (vh, 3, 14, 14), torch.bfloat16
    yield "vision_tower.patch_embed.pos_emb.weight", (p.vision_pos, p.vision_pos, vh), torch.bfloat16
    for j in range(p.vision_blocks):
        b = f"vision_tower.encoder.blocks.{j}"
        yield f"{b}.norm0.weight", (vh,), torch.bfloat16
        yield f"{b}.norm1.weight", (vh,), torch.bfloat16
        yield f"{b}.wqkv.weight", (3 * qkv, vh), torch.bfloat16
        yield f"{b}.wo.weight", (vh, qkv), torch.bfloat16
        yield f"{b}.mlp.fc0.weight", (p.vision_inter, vh), torch.bfloat16
        yield f"{b}.mlp.fc1.weight", (vh, p.vision_inter), torch.bfloat16
    yield "vision_tower.encoder.final_layernorm.weight", (vh,), torch.bfloat16


def _deepseek(p: Preset) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    h = p.hidden
    for name, shape, dtype in _deepseek_bf16(p):
        fp8 = name.endswith("_proj.weight") and dtype == torch.bfloat16
        yield name, shape, (torch.float8_e4m3fn if fp8 else dtype)
    yield "lm_head.weight", (p.vocab, h), torch.bfloat16


def _deepseek_bf16(p: Preset) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    h = p.hidden
    yield "model.embed_tokens.weight", (p.vocab, h), torch.bfloat16
    for i in range(p.layers):
        pre = f"model.layers.{i}"
        yield f"{pre}.input_layernorm.weight", (h,), torch.bfloat16
        yield f"{pre}.post_attention_layernorm.weight", (h,), torch.bfloat16
        yield from _mla(p, f"{pre}.self_attn")
        if i < p.first_dense:
            yield from _mlp(f"{pre}.mlp", h, p.dense_inter)
            continue
        yield f"{pre}.mlp.gate.weight", (p.experts, h), torch.bfloat16
        yield f"{pre}.mlp.gate.e_score_correction_bias", (p.experts,), torch.float32
        yield from _mlp(f"{pre}.mlp.shared_experts", h, p.moe_inter * p.shared)
        for e in range(p.experts):
            yield from _mlp(f"{pre}.mlp.experts.{e}", h, p.moe_inter)
    yield "model.norm.weight", (h,), torch.bfloat16


def fp8_block(name: str, shape: tuple[int, int], seed: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 e4m3 weight and its fp32 weight_scale_inv [ceil(M/128), ceil(N/128)], DeepSeek style."""
    w = weight(name, shape, seed, torch.float32)
    m, n = shape
    bm, bn = -(-m // block), -(-n // block)
    pad = torch.zeros(bm * block, bn * block)
    pad[:m, :n] = w
    amax = pad.view(bm, block, bn, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    q = (pad.view(bm, block, bn, block) / scale[:, None, :, None]).view(bm * block, bn * block)[:m, :n]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.float()


def _text_config(p: Preset) -> dict:
    """The text config as the releases spell it (flat for Kimi Linear, ``text_config`` for K3)."""
    kinds = p.kinds()
    k3 = p.arch == "kimi_k3"
    lac: dict = {
        "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "kda"],
        "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "mla"],
        "num_heads": p.kda_heads,
        "head_dim": p.kda_head_dim,
        "short_conv_kernel_size": p.conv,
    }
    if p.full_rank_gate:  # read as linear_attn_config["use_full_rank_gate"] by both engines
        lac.update(use_full_rank_gate=True, gate_lower_bound=-5.0)
    cfg: dict = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": p.vocab,
        "hidden_size": p.hidden,
        "intermediate_size": p.dense_inter,
        "num_hidden_layers": p.layers,
        "num_attention_heads": p.mla_heads,
        "num_key_value_heads": p.mla_heads,
        "hidden_act": "situ" if k3 else "silu",
        "q_lora_rank": p.q_lora or None,
        "kv_lora_rank": p.kv_lora,
        "qk_nope_head_dim": p.nope,
        "qk_rope_head_dim": p.rope,
        "v_head_dim": p.v_head,
        "mla_use_nope": True,  # vLLM asserts it (its Kimi MLA is NoPE-only)
        "num_experts": p.experts,
        "num_experts_per_token": p.topk,
        "num_shared_experts": p.shared,
        "moe_intermediate_size": p.moe_inter,
        "first_k_dense_replace": p.first_dense,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "dtype" if k3 else "torch_dtype": "bfloat16",
        "linear_attn_config": lac,
    }
    if k3:
        cfg.update(
            mla_use_output_gate=True,
            activation_situ_beta=4.0,
            activation_situ_linear_beta=25.0,
            routed_expert_hidden_size=p.latent,
            latent_moe_use_norm=True,
        )
        if p.attn_res_block:
            cfg["attn_res_block_size"] = p.attn_res_block
        cfg["auto_map"] = {"AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
                           "AutoModel": "modeling_kimi_linear.KimiLinearModel",
                           "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM"}
    if p.mxfp4_experts:  # the release keeps it in text_config only (KimiK3Config copies it up when loaded)
        cfg["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
    return cfg


# The released K3 text_config.quantization_config (compressed-tensors MXFP4, group 32, E8M0 scales):
# targets every Linear; what stays BF16 is named by `ignore`.
MXFP4_QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized",
        "input_activations": None,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                    "strategy": "group", "symmetric": True, "type": "float", "zp_dtype": None},
    }},
    "format": "mxfp4-pack-quantized",
    "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def _vision_config(p: Preset) -> dict:
    """K3's vision_config with the release's keys (KimiK3VisionConfig in both engines)."""
    return {
        "activation_func": "gelu_pytorch_tanh",
        "attn_bias": False,
        "init_pos_emb_height": p.vision_pos,
        "init_pos_emb_time": 4,
        "init_pos_emb_width": p.vision_pos,
        "linear_bias": False,
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mlp_type": "mlp2",
        "mm_hidden_size": p.vision_hidden,
        "mm_projector_type": "patchmergerv2",
        "norm_type": "rmsnorm",
        "patch_embed_proj_bias": False,
        "patch_size": 14,
        "pos_emb_interpolation_mode": "bilinear",
        "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "qkv_hidden_size": p.vision_qkv,
        "text_hidden_size": p.hidden,
        "vt_hidden_size": p.vision_hidden,
        "vt_intermediate_size": p.vision_inter,
        "vt_num_attention_heads": p.vision_heads,
        "vt_num_hidden_layers": p.vision_blocks,
    }


def _deepseek_config(p: Preset) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": p.hidden,
        "num_hidden_layers": p.layers, "vocab_size": p.vocab, "intermediate_size": p.dense_inter,
        "num_attention_heads": p.mla_heads, "q_lora_rank": p.q_lora, "kv_lora_rank": p.kv_lora,
        "qk_nope_head_dim": p.nope, "qk_rope_head_dim": p.rope, "v_head_dim": p.v_head,
        "n_routed_experts": p.experts, "num_experts_per_tok": p.topk, "n_shared_experts": p.shared,
        "moe_intermediate_size": p.moe_inter, "first_k_dense_replace": p.first_dense, "moe_layer_freq": 1,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    }


def config(p: Preset) -> dict:
    family = _family_module(p)
    if family is not None:
        return family.config(p)
    if p.arch == "deepseek_v3":
        return _deepseek_config(p)
    text = _text_config(p)
    if p.arch == "kimi_linear":
        return {**text, "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                                     "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"}}
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                     "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
        "dtype": "bfloat16",
        "ignore_index": -100,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "model_type": "kimi_k3",
        "text_config": text,
        "tie_word_embeddings": False,
        "vision_config": _vision_config(p),
    }


SIDE_FILES = {
    "tokenizer_config.json": json.dumps({"tokenizer_class": "TikTokenTokenizer", "model_max_length": 262144,
                                         "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}},
                                        indent=2),
    "tiktoken.model": "".join(f"IQ== {i}\n" for i in range(64)),
    "chat_template.jinja": "{% for m in messages %}<|im_{{ m.role }}|>{{ m.content }}<|im_end|>{% endfor %}\n",
    "generation_config.json": json.dumps({"max_length": 262144, "eos_token_id": 163586}, indent=2),
    "tokenization_kimi.py": "# synthetic stand-in for the release's custom tokenizer code\n",
    # as a Hub download has them: the repo's LFS rules, and documents in a sub-folder
    ".gitattributes": "".join(f"*.{x} filter=lfs diff=lfs merge=lfs -text\n" for x in ("safetensors", "model")),
    "docs/deploy_guidance.md": "# Deployment\n\nSynthetic stand-in for the release's deployment notes.\n",
}


def _cuts(specs: list, shards: int) -> list[int]:
    """Equal-count shard boundaries, each moved onto the next k_proj/up_proj so that, as in real
    releases, fused groups take their members from two files."""
    per = -(-len(specs) // shards)
    cuts = [0]
    for b in range(per, len(specs), per):
        while b < len(specs) and not specs[b][0].endswith((".k_proj.weight", ".up_proj.weight")):
            b += 1
        if cuts[-1] < b < len(specs):
            cuts.append(b)
    return [*cuts, len(specs)]


def _spec_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes a spec takes on disk (an MXFP4 weight: its packed codes and its E8M0 scales)."""
    if dtype == torch.uint8:
        n, k = shape
        return n * k // 2 + n * k // 32
    return math.prod(shape) * dtype.itemsize


_EXPERT_REST = re.compile(r"\.experts\.\d+\.w[23]\.weight$")  # an expert's tensors after its first


def _byte_cuts(specs: list, shards: int) -> list[int]:
    """Shard boundaries of about equal bytes: a cut where the running size passes the next multiple of
    total/shards (a tensor larger than that spans several: fewer shards, none tiny), never inside an
    expert (the release keeps an expert's w1, w2, w3 in one file; NVIDIA's converter needs w1 and w3 of
    an expert in one shard, as they share one scale_2)."""
    sizes = [_spec_bytes(shape, dtype) for _, shape, dtype in specs]
    total, done, cuts, k = sum(sizes), 0, [0], 1
    for i, size in enumerate(sizes):
        inside_expert = _EXPERT_REST.search(specs[i][0]) is not None
        if done >= total * k / shards and i > cuts[-1] and not inside_expert:
            cuts.append(i)
            while done >= total * k / shards:
                k += 1
        done += size
    return [*cuts, len(specs)]


def write_synth(preset: str, out: str | Path, seed: int = 0, layers: int | None = None,
                experts: int | None = None, overwrite: bool = False, jobs: int = 1,
                shards: int | None = None) -> Path:
    """Write the preset's checkpoint into ``out``; ``jobs`` shards at once (threads: torch releases the
    GIL), the same bytes for any ``jobs`` (each tensor's values come from its own name's generator)."""
    if preset not in PRESETS:
        raise ConvertError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if layers is not None:
        p = replace(p, layers=layers)
    if experts is not None:
        p = replace(p, experts=experts)
    if shards is not None:
        p = replace(p, shards=shards)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConvertError(f"{out}: not empty; pass --overwrite to replace it")
        if not (out / "config.json").exists():
            raise ConvertError(f"{out}: not empty and not a checkpoint; refusing to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if p.sparse:
        return _write_rest(p, out, *write_sparse(p, out), sort_keys=True)
    if p.arch in GPTOSS_ARCHES:
        return _write_rest(p, out, *synth_gptoss.write(p, out, seed, weight, mxfp4))
    specs = list(tensor_specs(p))
    cuts = _byte_cuts(specs, p.shards) if p.cut_by_bytes else _cuts(specs, p.shards)
    n = len(cuts) - 1
    deferred: dict[str, torch.Tensor] = {}  # FP8 scales stored in another shard than their weight

    def one(s: int) -> tuple[str, dict[str, int]]:
        fname = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = deferred if s == n - 1 else {}
        for name, shape, dtype in specs[cuts[s] : cuts[s + 1]]:
            if dtype == torch.float8_e4m3fn:
                base = name[: -len(".weight")]
                tensors[name], scale = fp8_block(name, shape, seed)
                apart = p.arch == "deepseek_v3" and ".layers.1." in name and s < n - 1  # the old preset's test case
                (deferred if apart else tensors)[f"{base}.weight_scale_inv"] = scale
            elif dtype == torch.uint8:
                wide = name.endswith("layers.1.block_sparse_moe.experts.0.w2.weight")
                base = name[: -len(".weight")]
                tensors[f"{base}.weight_packed"], tensors[f"{base}.weight_scale"] = mxfp4(name, shape, seed, wide)
            else:
                tensors[name] = weight(name, shape, seed, dtype)
                if name.endswith(".A_log") and len(shape) == 1:
                    tensors[name][p.kda_heads:] = 0  # K3 stores A_log [head_dim], zero past num_heads
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        os.chmod(out / fname, default_mode())  # save_file makes 0o600; every file of the folder the same
        return fname, {k: v.numel() * v.element_size() for k, v in tensors.items()}

    if p.fp8 or jobs <= 1:  # FP8: the last shard takes scales deferred by the others (in order)
        shards = [one(s) for s in range(n)]
    else:
        with ThreadPoolExecutor(jobs, thread_name_prefix="kimi-convert-synth") as ex:
            shards = list(ex.map(one, range(n)))
    weight_map = {k: fname for fname, sizes in shards for k in sizes}
    return _write_rest(p, out, weight_map, sum(sum(sizes.values()) for _, sizes in shards))


def _write_rest(p: Preset, out: Path, weight_map: dict[str, str], total: int, sort_keys: bool = False) -> Path:
    """The index, config.json and the side files."""
    (out / INDEX_NAME).write_text(index_text(weight_map, total, sort_keys))
    (out / "config.json").write_text(json.dumps(config(p), indent=2) + "\n")
    code = {"kimi_k3": "configuration_kimi_k3.py", "kimi_linear": "configuration_kimi.py"}.get(
        p.arch, "configuration_deepseek.py")
    side = {**SIDE_FILES, code: "# synthetic stand-in for the release's custom config code\n"}
    family = _family_module(p)
    if family is not None:  # the family module's own side files (no custom code for transformers' classes)
        side = family.SIDE_FILES
    for name, text in side.items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text(text)
    return out


_PLAIN = re.compile(r"[\w.\-]*", re.ASCII)  # names json writes as they are, between quotes


def index_text(weight_map: dict[str, str], total: int, sort_keys: bool = False) -> str:
    """The index as ``json.dumps(indent=2)`` writes it (sorted, as ``save_pretrained`` writes it, for the
    sparse presets); sorted without json's pure-Python indenting encoder (5x faster for 500k names)."""
    plain = all(_PLAIN.fullmatch(k) and _PLAIN.fullmatch(v) for k, v in weight_map.items())
    if not sort_keys or not plain:
        return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2,
                          sort_keys=sort_keys) + "\n"
    rows = ",\n".join(f'    "{k}": "{weight_map[k]}"' for k in sorted(weight_map))
    return f'{{\n  "metadata": {{\n    "total_size": {total}\n  }},\n  "weight_map": {{\n{rows}\n  }}\n}}\n'


# safetensors orders a file's data by dtype (its enum order, descending), then by name; so do we.
_ST_DTYPE_RANK = {"U8": 4, "F8_E4M3": 7, "BF16": 12, "F32": 15}
_ST_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3"}


def _stored(p: Preset) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """Every stored tensor (name, safetensors dtype, shape): an MXFP4 weight as its two U8 parts."""
    for name, shape, dtype in tensor_specs(p):
        if dtype == torch.uint8:  # MXFP4: packed E2M1 codes [N, K/2] and E8M0 scales [N, K/32]
            base = name[: -len(".weight")]
            n, k = shape
            yield f"{base}.weight_packed", "U8", (n, k // 2)
            yield f"{base}.weight_scale", "U8", (n, k // 32)
        else:
            yield name, _ST_NAMES[dtype], shape


def write_sparse(p: Preset, out: Path) -> tuple[dict[str, str], int]:
    """Shards with real safetensors headers and every data region a hole (``os.truncate``, no data
    written): the release's inventory at full size on a few hundred MB of real disk. Shards are cut by
    bytes, at most ``p.shards`` of them, an MXFP4 weight's two parts in one shard. Deterministic."""
    itemsize = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4}
    specs = [(name, dt, shape, math.prod(shape) * itemsize[dt]) for name, dt, shape in _stored(p)]
    total = sum(s[3] for s in specs)
    groups: list[list[tuple[str, str, tuple[int, ...], int]]] = [[]]
    done, k = 0, 1
    for i, spec in enumerate(specs):
        # a cut only where the previous tensor was not the first part of an MXFP4 pair
        if done >= total * k / p.shards and groups[-1] and not specs[i - 1][0].endswith(".weight_packed"):
            groups.append([])
            while done >= total * k / p.shards:
                k += 1
        groups[-1].append(spec)
        done += spec[3]
    n = len(groups)
    weight_map: dict[str, str] = {}
    for s, group in enumerate(groups):
        fname = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        group.sort(key=lambda t: (-_ST_DTYPE_RANK[t[1]], t[0]))
        starts = list(itertools.accumulate((t[3] for t in group), initial=0))
        head = encode_header([HeaderTensor(name, dt, shape) for name, dt, shape, _ in group], starts[:-1], starts[1:],
                             align=8)  # the header written as pack writes its own (data 8-byte aligned here)
        weight_map.update(dict.fromkeys((t[0] for t in group), fname))
        path = out / fname
        with open(path, "wb") as f:
            f.write(head)
        os.truncate(path, len(head) + starts[-1])
    return weight_map, total
