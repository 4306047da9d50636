"""Load a checkpoint with SGLang's own code, on the CPU, and report what every parameter received.

Run by ``kimi_convert.enginecheck`` in SGLang's python: ``python sglang_runner.py MODEL_DIR --out FILE``.
Must not import ``kimi_convert``. SGLang parses the checkpoint with its own ``ServerArgs`` and
``ModelConfig``, picks the model class from its registry, resolves the quantization config with
its loader's ``_get_quantization_config``, builds the model with ``_initialize_model`` and loads it
with ``DefaultModelLoader.load_weights_only`` over ``_get_all_weights`` (its weight iterator and the
model's ``load_weights``). Quant methods' ``process_weights_after_loading`` (repacking into GPU
kernel layouts) is not run: the check reads the parameters as the loader left them.

Every patch is in ``PATCHES`` / ``apply_patches`` below, with why it is safe. None touches config
parsing, ``load_weights``, weight loaders, quant methods' ``create_weights`` or parameter classes.
"""

from __future__ import annotations

import re
import time

import runner_common as rc
import torch

#: Parameters SGLang legitimately leaves unwritten by a checkpoint (regex on the parameter name, why).
OPTIONAL = [
    (r"\.(k|v|q)_scale$", "KV-cache quantization scale: SGLang uses 1.0 when a checkpoint has none"),
    (r"experts\.w(13|2)_weight_bias$",
     "Mxfp4MoEMethod.create_weights makes zero expert biases on CUDA whatever the checkpoint (gpt-oss has "
     "them; Kimi has none)"),
    (r"^vision_tower\.vision_model\.post_layernorm\.(weight|bias)$",
     "MiniMax VL vision tower: SGLang's MiniMaxVLVisionTransformer.__init__ builds post_layernorm when every encoder "
     "layer is built (srt/models/minimax_vl_common.py require_post_norm) but its forward never reads it; the "
     "MiniMax-M3 release ships none (vLLM's models/minimax_m3/common/vision_tower.py MiniMaxVLVisionModel says so "
     "and builds it with require_post_norm=False)"),
    (r"experts\.w(13|2)_blockscale_swizzled$",
     "ModelOptNvFp4FusedMoEMethod.create_weights makes it as swizzle(w13/w2_weight_scale) before loading; "
     "process_weights_after_loading recomputes it from the loaded weight_scale"),
]

def optional_for(model) -> list[tuple[str, str]]:
    """Parameters optional for this model as SGLang built it (decided from its own quant methods, and ZAYA1's first
    router's state scale, which its forward never reads)."""
    out = []
    first_router = next((n for n, m in model.named_modules() if type(m).__name__ == "ZayaRouter"), None)
    if first_router is not None:
        out.append((rf"^{re.escape(first_router)}\.router_states_scale$",
                    "ZAYA1's first MoE layer: zaya.py ZayaRouter.__init__ builds router_states_scale on every MoE "
                    "layer when zaya_use_eda, its forward reads it only with a previous MoE layer's router state, "
                    "which ZayaModel.forward never gives the first (prev_router_hidden_states None); the release "
                    "stores none there"))
    for name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if type(qm).__name__ == "ModelOptNvFp4A16LinearMethod" and hasattr(module, "input_scale"):
            out.append((rf"^{re.escape(name)}\.input_scale$",
                        "weight-only (W4A16_NVFP4) linear: SGLang's ModelOptNvFp4A16LinearMethod registers input_scale "
                        "only for fused-loader compatibility and deletes it after loading"))
        elif type(qm).__name__ == "ModelOptNvFp4FusedMoEMethod" and getattr(module, "num_fused_shared_experts", 0):
            out.extend(_fused_shared_input_scales(name, module.num_fused_shared_experts))
        elif getattr(qm, "quant_mode", None) == "w4a16" and hasattr(module, "input_scale"):
            out.append((rf"^{re.escape(name)}\.input_scale$",
                        "weight-only (W4A16) NVFP4 linear: SGLang's ModelOptFp4LinearMethod reads input_scale only "
                        "in quant_mode w4a4; w4a16 builds its GEMM alpha from weight_scale_2 alone"))
    return out


def loadable_buffers(model) -> set[str]:
    """The buffers SGLang's loaders fill from a checkpoint tensor of the same name: every buffer, persistent or not.
    Its ``AutoWeightsLoader._load_module`` (srt/models/utils.py) offers a module's tensors to
    ``named_buffers(recurse=False)`` beside its parameters, and the model loaders that fill buffers index all of
    them (gemma4_causal.py ``Gemma4ForCausalLM.load_weights``: ``params_dict.update(dict(self.named_buffers()))``,
    which fills ``layer_scalar``; zaya.py ``load_weights``: ``buffers_dict``)."""
    return {n for n, _ in model.named_buffers()}


def _fused_shared_input_scales(name: str, fused: int) -> list[tuple[str, str, int]]:
    """A shared expert SGLang fuses into the routed experts as expert slot E.. (``num_fused_shared_experts``:
    MiniMax M3's loader renames ``mlp.shared_experts.*`` to ``mlp.experts.{E}.w1/w2/w3``, srt/models/minimax_m3_vl.py
    _load_llm_weight) is a dense MLP in the checkpoint, with no input_scale; ModelOptNvFp4FusedMoEMethod.create_weights
    fills w13/w2_input_scale with 1.0 (layers/quantization/modelopt_quant.py ``input_scale_fill``), which that slot
    keeps: the value a routed expert's written input_scale has."""
    why = ("input_scale of the shared expert fused as a routed expert slot: ModelOptNvFp4FusedMoEMethod.create_weights "
           "fills it with 1.0 (modelopt_quant.py input_scale_fill) and the checkpoint's dense shared expert has none")
    return [(rf"^{re.escape(name)}\.w13_input_scale$", why, 2 * fused),
            (rf"^{re.escape(name)}\.w2_input_scale$", why, fused)]


def mtp_rule(config):
    """SGLang's own rule for the MTP layers a main model drops, written inline in its load_weights
    (GLM-4.5: srt/models/glm4_moe.py Glm4MoeForCausalLM.load_weights, ``not is_nextn``: a name
    ``model.layers.{i}...`` with i >= num_hidden_layers is skipped when num_nextn_predict_layers > 0); the
    MTP model (glm4_moe_nextn.py Glm4MoeForCausalLMNextN) loads those."""
    glm5_next = getattr(config, "model_type", None) == "glm5_next"
    counts = getattr(config, "text_config", config) if glm5_next else config
    n = getattr(counts, "num_nextn_predict_layers", 0) or 0
    base = getattr(counts, "num_hidden_layers", 0)

    minimax_m3 = minimax_m3_mtp_rule(getattr(config, "text_config", config))
    mimo_v2 = rc.is_mimo_v2(config)
    inkling = rc.is_inkling(config)

    def why(name: str) -> str | None:
        if (m3 := minimax_m3(name)) is not None:
            return m3
        if glm5_next:  # GLM-5.3-Flash: srt/models/glm5_next.py Glm5NextForConditionalGeneration.load_weights drops
            name = name.replace("language_model.", "", 1)  # "language_model." first, then applies the same rule
        if name.startswith("mtp.") and getattr(getattr(config, "text_config", config), "mtp_num_hidden_layers", 0):
            return ("MTP block (mtp_num_hidden_layers): SGLang's main model skips names with 'mtp' in "
                    "load_weights (srt/models/qwen3_5.py Qwen3_5MoeForConditionalGeneration.load_weights); its "
                    "MTP model (qwen3_5_mtp.py) loads it")
        if name.startswith("mtp.") and n > 0 and getattr(config, "model_type", None) == "deepseek_v4":
            return ("MTP layer (num_nextn_predict_layers): SGLang's DeepSeek V4 main model skips names starting "
                    "'mtp' (srt/models/deepseek_v4.py DeepseekV4ForCausalLM.load_weights, not is_nextn); its NextN "
                    "model (deepseek_v4_nextn.py) loads them")
        if name.startswith("model.mtp.") and inkling:
            return ("MTP head (model.mtp.*): SGLang's Inkling main model has no parameter for it and passes it "
                    "(srt/models/inkling.py InklingForConditionalGeneration.load_weights); its draft "
                    "(InklingForConditionalGenerationMTP) loads it")
        if name.startswith("model.mtp.layers.") and mimo_v2:
            return ("MTP layer (model.mtp.layers.*): SGLang's MiMo-V2 main model skips every name holding 'mtp' "
                    "(srt/models/mimo_v2.py MiMoV2ForCausalLM.load_weights); its MTP model (mimo_v2_nextn.py "
                    "MiMoV2MTP) loads it")
        parts = name.split(".")
        if not (n > 0 and name.startswith("model.layers") and len(parts) >= 3 and parts[2].isdigit()
                and int(parts[2]) >= base):
            return None
        return (f"MTP layer {parts[2]} (num_nextn_predict_layers): SGLang's main model drops it in load_weights "
                "(layer >= num_hidden_layers); its NextN model loads it")
    return why


def minimax_m3_mtp_rule(config):
    """MiniMax M3's MTP modules (``language_model.model.mtp.layers.{i}.*``): SGLang's main model skips the names
    its ``get_spec_layer_idx_from_weight_name`` finds (srt/models/minimax_m3.py: ``model.mtp.layers.{i}.`` for
    i < ``num_mtp_modules``), called from MiniMaxM3SparseForConditionalGeneration._load_llm_weight (minimax_m3_vl.py)
    on the name without ``language_model.``. SGLang 0.5.23 registers no MiniMax M3 MTP model."""
    n = getattr(config, "num_mtp_modules", 0) or 0

    def why(name: str) -> str | None:
        m = re.match(r"(?:language_model\.)?model\.mtp\.layers\.(\d+)\.", name)
        if not (n > 0 and m and int(m.group(1)) < n):
            return None
        return (f"MTP module {m.group(1)} (num_mtp_modules): SGLang's main model skips it "
                "(srt/models/minimax_m3.py get_spec_layer_idx_from_weight_name); SGLang 0.5.23 has no MiniMax M3 "
                "MTP model to load it")
    return why


def qkv_a_scalar_rule(tracker):
    """SGLang's rule for the one-element tensors (NVFP4 ``weight_scale_2``, ``input_scale``) of DeepSeek's two MLA
    down-projections: models/deepseek_common/deepseek_weight_loader.py ``do_load_weights`` caches q_a_proj and
    kv_a_proj_with_mqa (``cached_a_proj``, :438) and, where both are 0-d, loads q_a_proj's alone into
    fused_qkv_a_proj_with_mqa (:463-466; other tensors are ``torch.cat``-ed, :476), a ReplicatedLinear
    (models/deepseek_v2.py:2070) holding one slot. Right only where kv_a's value equals q_a's (one global scale
    shared over the fused layer, as this tool writes): otherwise kv_a's rows are read with q_a's scale."""

    def why(name: str) -> tuple[str, bool] | None:
        # DeepSeek's names, or Mistral Large 3's (wq_a / wkv_a_with_mqa: models/mistral_large_3.py remapping)
        partner = name.replace(".kv_a_proj_with_mqa.", ".q_a_proj.").replace(".wkv_a_with_mqa.", ".wq_a.")
        fused = next((t for t in tracker.stored.get(partner, ())
                      if t.endswith(f".fused_qkv_a_proj_with_mqa.{name.rpartition('.')[2]}")), None)
        if partner == name or name not in tracker.scalars or partner not in tracker.scalars or fused is None:
            return None
        mine, kept = tracker.scalars[name], tracker.scalars[partner]
        verb = "equal to" if mine == kept else "NOT equal to"
        return (f"SGLang loads only {partner} ({kept!r}) into {fused} and drops this one ({mine!r}), {verb} it "
                "(deepseek_weight_loader.py do_load_weights:463-466)", mine == kept)
    return why


#: Every patch, with why it is safe (docs/engine-checks.md lists the same).
PATCHES = [
    ("torch.cuda device queries",
     "torch.cuda.is_available/current_device/set_device/get_device_capability/get_device_properties/"
     "device_count/memory stats answer for one presented B200 (capability 10.0): SGLang's module-level "
     "is_cuda()/sm100 flags pick the Blackwell code paths; queries only, no loading code changed"),
    ("torch.cuda streams/events",
     "torch.cuda.Stream/Event (and current/default stream) made in constructors return inert objects: they "
     "only order kernels at run time, never hold weights"),
    ("cuda allocations on the CPU",
     "a TorchFunctionMode rewrites an explicit device='cuda' (and .cuda()/.to('cuda')) to the CPU; values, "
     "dtypes and shapes are unchanged"),
    ("distributed",
     "a single-process gloo group (world size 1, TP=1) through SGLang's own init_distributed_environment, "
     "initialize_model_parallel and initialize_dp_attention; no collective moves weights at TP=1"),
    ("weight iterator observed",
     "the weights DefaultModelLoader._get_all_weights yields are recorded on their way to load_weights, "
     "unchanged"),
    ("post_load_weights deferred",
     "the model's post_load_weights (called at the end of its load_weights: derives kernel buffers such as "
     "MLA w_kc/w_vc and warms Triton kernels from already-stored parameters) runs after the check, and its "
     "outcome is reported separately: it stores no checkpoint tensor"),
    ("DeepSeek weights loaded synchronously",
     "models/deepseek_common/deepseek_weight_loader.py hands CPU tensors to a ThreadPoolExecutor "
     "(model_loader/utils.py should_async_load: True for a CPU tensor), whose threads the load observer does "
     "not see; should_async_load answers False there, SGLang's own synchronous path (the one it takes for "
     "device and RunAI tensors): the same weight_loader calls, in order, on the loading thread; "
     "likewise models/deepseek_v4.py, which imports should_async_load itself"),
    ("DeepGEMM SM count",
     "deep_gemm.get_num_sms (a CUDA runtime query; DeepSeek V3.2's DSA Indexer.__init__ sizes a schedule buffer "
     "with it, layers/attention/dsa/utils.py resolve_num_sms) answers the presented B200's SM count, as "
     "torch.cuda.get_device_properties does: a device query only"),
    ("DeepSeek V4 kernel prewarm deferred",
     "models/deepseek_v4.py DeepseekV4ForCausalLM.load_weights ends with _prewarm_mhc_kernels, which compiles and "
     "runs the mHC GPU kernels once on zeros (no CPU build exists) and stores no parameter; the model's own "
     "guard _mhc_prewarmed_at_load is set True before loading, so it returns at once"),
    ("Inkling's CUDA JIT warm-ups off",
     "models/inkling.py InklingCausalLLM.__init__ compiles its fused attention prologue and custom all-reduce kernels "
     "when is_cuda() (the stand-in answers yes, with no libcudart to link them): SGLang's own switches "
     "SGLANG_OPT_USE_INKLING_FUSED_ATTN_PROLOGUE=0 and SGLANG_OPT_USE_INKLING_CUSTOM_AR=0 (srt/environ.py), set "
     "unless the caller set them; a kernel choice, no parameter or loader depends on it"),
]

#: SGLang's own environment switches the stand-in sets (PATCHES says why each)
ENV_SWITCHES = {"SGLANG_OPT_USE_INKLING_FUSED_ATTN_PROLOGUE": "0", "SGLANG_OPT_USE_INKLING_CUSTOM_AR": "0"}


def apply_patches(result: dict) -> None:
    import os

    for k, v in ENV_SWITCHES.items():
        os.environ.setdefault(k, v)
    rc.patch_torch_cuda(rc.CAPABILITY, rc.DEVICE_NAME, rc.DEVICE_MEMORY, available=True)
    _deep_gemm_sm_count()
    result["patches"] = [name for name, _ in PATCHES]


def _deep_gemm_sm_count() -> None:
    """See PATCHES ("DeepGEMM SM count")."""
    try:
        import deep_gemm
    except Exception:  # not installed, or not importable here: nothing asks it then
        return
    deep_gemm.get_num_sms = lambda: torch.cuda.get_device_properties(0).multi_processor_count


def preload() -> None:
    """What ``run`` starts with (the patches, then SGLang's imports, which import every model module of its
    registry), and the numeric check's module: done once by the fork server (``zygote.py``)."""
    apply_patches({})
    with rc.CpuDevices():
        rc.import_all(["sglang.srt.configs.model_config", "sglang.srt.distributed.parallel_state",
                       "sglang.srt.layers.dp_attention", "sglang.srt.layers.moe", "sglang.srt.model_loader.loader",
                       "sglang.srt.models.registry", "sglang.srt.runtime_context", "sglang.srt.server_args",
                       "runner_numerics"])


def _load_deepseek_synchronously() -> None:
    """See PATCHES ("DeepSeek weights loaded synchronously")."""
    from sglang.srt.models.deepseek_common import deepseek_weight_loader

    deepseek_weight_loader.should_async_load = lambda weight: False
    from sglang.srt.models import deepseek_v4

    deepseek_v4.should_async_load = lambda weight: False


def from_target(model) -> list[tuple[str, str, str]]:
    """The draft's parameters SGLang's speculative worker replaces with the target model's after loading the draft
    (speculative/eagle_worker_v2.py ``init_lm_head``: ``set_embed_and_head(embed, head)``, which NextN / MTP models
    define as swapping in ``model.embed_tokens.weight`` and ``lm_head.weight``): what the draft does not need from the
    checkpoint; anything it does load into them must still load."""
    if not hasattr(model, "set_embed_and_head"):
        return []
    why = ("taken from the target model: SGLang's speculative worker (speculative/eagle_worker_v2.py init_lm_head) "
           f"calls {type(model).__name__}.set_embed_and_head with the target's embedding and lm_head after the draft "
           "is loaded")
    return [(r"^model\.embed_tokens\.weight$", why, "embed_tokens"), (r"^lm_head\.weight$", why, "lm_head")]


def draft_rule(config):
    """The draft's side of the MTP rule: a checkpoint tensor the main model's MTP rule does not assign to an MTP
    layer is the main model's, and the draft drops it (glm4_moe.py Glm4MoeForCausalLM.load_weights with
    ``is_nextn``: only ``model.layers.{num_hidden_layers}.*``; deepseek_nextn.py likewise; qwen3_5_mtp.py only
    ``mtp.*``)."""
    mtp = mtp_rule(config)

    def why(name: str) -> str | None:
        if not mtp(name):
            return "the main model's tensor (no MTP layer by SGLang's own rule): its draft model drops it on purpose"
        if "shared_head.head" in name or "embed_tokens" in name:
            return ("the MTP layer's own copy of the target's lm_head / embedding: SGLang's NextN loader skips it to "
                    "use the target model's (models/deepseek_common/deepseek_weight_loader.py do_load_weights: "
                    "'Use shared head and embed weights from target model'; set_embed_and_head)")
        return None
    return why


def deployment_args(model_dir: str) -> dict:
    """Server arguments a deployment of this checkpoint has to pass, where SGLang's defaults refuse it. A DSA model
    with an index k-pool gets ``page_size = 64 * index_kpool`` (arg_groups/model_overrides/deepseek_v2.py: "a logical
    page must own a whole pooled index group"), and a hybrid linear-attention model's radix cache asserts
    ``mamba_track_interval % page_size == 0`` (arg_groups/mamba_hook.py validate_mamba_extra_buffer) against the
    default interval of 256: GLM-5.3-Flash (index_kpool 16, page 1024) is served with ``--mamba-track-interval``
    a multiple of the page. A cache setting only: no weight, parameter or loader depends on it. A checkpoint with a
    vision tower is served with it in use (``--enable-multimodal``): SGLang turns multimodal off by default for a few
    architectures (configs/model_config.py ``mm_disabled_models``: Llama4ForConditionalGeneration...), and then
    ``mllama4.py`` ``Llama4ForConditionalGeneration`` builds no vision tower and skips its weights
    (``_should_skip_weight``), which would leave the tower's tensors unchecked."""
    config = rc.config_json(model_dir)
    if config is None:
        return {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    out: dict = {"enable_multimodal": True} if isinstance(config.get("vision_config"), dict) else {}
    kpool = text.get("index_kpool")
    default_interval = 256
    if isinstance(kpool, int) and kpool > 0 and default_interval % (64 * kpool) and text.get("linear_attn_config"):
        out["mamba_track_interval"] = 64 * kpool
    return out


def banded_mtp(model_dir: str) -> bool:
    """Whether the checkpoint's MTP head is banded (Inkling: ``mtp_config.local_layer_ids``, depths with sliding-window
    attention), which SGLang's draft builds only as a multi-layer EAGLE draft: ``InklingForConditionalGenerationMTP``
    raises "a banded MTP head (mtp_local_layer_ids set) requires --enable-multi-layer-eagle" without it
    (srt/models/inkling.py), and that draft worker builds one model a depth, the first with ``draft_model_idx`` 0
    (managers/tp_worker.py ``_init_model_runner``), whose loader keeps that depth's MTP tensors alone
    (model_loader/loader.py ``_filter_mtp_weights``)."""
    mtp = (rc.config_json(model_dir) or {}).get("mtp_config")
    return isinstance(mtp, dict) and bool(mtp.get("local_layer_ids"))


def engine_config(model_dir: str, draft: bool, trust_remote_code: bool = False):
    """SGLang's own config for the checkpoint: with ``draft``, as a deployment asks for its draft
    (``--speculative-algorithm NEXTN``: the draft worker's ``ModelConfig.from_server_args(...,
    is_draft_model=True)``, managers/tp_worker.py ``_init_model_config``, which picks the NextN / MTP class,
    configs/model_config.py). Returns (server_args, model_config, load_config, loader, quant_config)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.model_loader.loader import _get_quantization_config, get_model_loader
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    banded = False
    kw = dict(model_path=model_dir, tp_size=1, disable_cuda_graph=True, trust_remote_code=trust_remote_code,
              load_format="auto", skip_server_warmup=True, **deployment_args(model_dir))
    if draft:
        # EAGLE: what SGLang resolves NEXTN to (arg_groups/speculative_hook.py), and the only spelling DeepSeek V4
        # takes (arg_groups/deepseek_v4_hook.py asserts "Only EAGLE and DSPARK ..." before that resolution)
        kw.update(speculative_algorithm="EAGLE", speculative_num_steps=1, speculative_eagle_topk=1,
                  speculative_num_draft_tokens=2)
        if banded := banded_mtp(model_dir):
            kw["enable_multi_layer_eagle"] = True
    server_args = ServerArgs(**kw)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    initialize_moe_config()
    model_config = (ModelConfig.from_server_args(server_args, model_path=model_dir, is_draft_model=True) if draft
                    else ModelConfig.from_server_args(server_args))
    load_config = LoadConfig(load_format="auto", draft_model_idx=0 if draft and banded else None)
    loader = get_model_loader(load_config=load_config, model_config=model_config)
    return server_args, model_config, load_config, loader, _get_quantization_config(model_config, load_config)


def _draft_scope(draft: bool):
    """The contexts SGLang's draft worker builds its model in (speculative/eagle_worker_v2.py EAGLEWorkerV2.__init__:
    ``speculative_moe_backend_context``, ``draft_model_build_scope``, layers/moe/utils.py)."""
    import contextlib

    if not draft:
        return contextlib.nullcontext()
    from sglang.srt.layers.moe.utils import draft_model_build_scope, speculative_moe_backend_context

    stack = contextlib.ExitStack()
    stack.enter_context(speculative_moe_backend_context())
    stack.enter_context(draft_model_build_scope())
    return stack


def run(model_dir: str, result: dict) -> None:
    t0 = time.perf_counter()
    result["phase"] = "import"
    apply_patches(result)
    with rc.CpuDevices():
        import sglang
        from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from sglang.srt.layers.dp_attention import init_dp_gathered_buffer, initialize_dp_attention
        from sglang.srt.model_loader.loader import _initialize_model, set_default_torch_dtype
        from sglang.srt.models.registry import ModelRegistry
        _load_deepseek_synchronously()
    result["version"] = getattr(sglang, "__version__", None)
    result["timings"]["import_s"] = round(time.perf_counter() - t0, 2)
    result["registered"] = rc.registered(model_dir, ModelRegistry.get_supported_archs())

    result["phase"] = "config"
    t = time.perf_counter()
    with rc.CpuDevices():
        server_args, model_config, load_config, loader, quant_config = engine_config(
            model_dir, result["draft"], result.get("trust_remote_code", False))
    result["architectures"] = list(getattr(model_config.hf_config, "architectures", None) or [])
    result["quantization"] = model_config.quantization
    result["quant_config"] = type(quant_config).__name__ if quant_config is not None else None
    result["timings"]["config_s"] = round(time.perf_counter() - t, 2)

    result["phase"] = "init"
    t = time.perf_counter()
    with rc.CpuDevices():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{rc.free_port()}")
        initialize_model_parallel()
        initialize_dp_attention(server_args=server_args)
        init_dp_gathered_buffer(model_config)
        prefixes = rc.watch_prefixes(quant_config) if result["derive"] else None
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"), _draft_scope(result["draft"]):
            model = _initialize_model(model_config, load_config, quant_config)
    result["model_class"] = f"{type(model).__module__}.{type(model).__qualname__}"
    result["timings"]["init_s"] = round(time.perf_counter() - t, 2)
    if result["derive"]:
        result["modules"] = rc.describe(model, prefixes)
        if result["derive"] == "build":
            result["phase"] = "done"
            return
    load(result, model_config, loader, model)


def load(result: dict, model_config, loader, model) -> None:
    """SGLang's own weight loading of ``model`` under the load observer, then the check (and the numeric read)."""
    from sglang.srt.model_loader.loader import DefaultModelLoader, set_default_torch_dtype

    result["phase"] = "load"
    t = time.perf_counter()
    tracker = rc.Tracker()
    tracker.arm(model, loadable_buffers(model))
    if hasattr(model, "_mhc_prewarmed_at_load"):
        model._mhc_prewarmed_at_load = True  # DeepSeek V4's kernel prewarm deferred; see PATCHES
    post_load = getattr(type(model), "post_load_weights", None)
    if post_load is not None:
        model.post_load_weights = lambda *a, **k: None  # deferred; see PATCHES
    error = None
    try:
        with rc.CpuDevices(), set_default_torch_dtype(model_config.dtype), tracker.mode():
            offered = (rc.spec_weights(result["weights_spec"]) if result["weights_spec"]
                       else loader._get_all_weights(model_config, model))
            weights = tracker.weights(offered)
            DefaultModelLoader.load_weights_only(model, weights, torch.device("cpu"))
    except Exception as e:
        error = e
    result["timings"]["load_s"] = round(time.perf_counter() - t, 2)
    result["phase"] = "check"
    config = model_config.hf_config
    if result["draft"]:
        result.update(tracker.result(model, OPTIONAL + optional_for(model), drop_rule=qkv_a_scalar_rule(tracker),
                                     main_rule=draft_rule(config), target=from_target(model)))
    else:
        result.update(tracker.result(model, OPTIONAL + optional_for(model), mtp_rule(config),
                                     qkv_a_scalar_rule(tracker)))
    if result["derive"]:
        result["spans"] = rc.spans(tracker)
    with rc.CpuDevices():  # before post_load_weights, which derives kernel buffers from the loaded weights
        rc.numerics("sglang", result, model, tracker, error)
    if post_load is not None and error is None:
        del model.post_load_weights
        try:
            with rc.CpuDevices():
                post_load(model)
            result["post_load"] = {"ok": True}
        except Exception as e:
            result["post_load"] = {"ok": False, **rc.exception_info(e)}
    rc.finish(result, error, tracker)


if __name__ == "__main__":
    rc.main("sglang", run)
