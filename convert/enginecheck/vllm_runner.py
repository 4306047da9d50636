"""Load a checkpoint with vLLM's own code, on the CPU, and report what every parameter received.

Run by ``kimi_convert.enginecheck`` in vLLM's python: ``python vllm_runner.py MODEL_DIR --out FILE``.
Must not import ``kimi_convert``. vLLM builds the model its registry picks for ``architectures``
from its own ``EngineArgs(...).create_engine_config()`` (config and quantization-config parsing),
initialises it with its own ``initialize_model`` and loads it with ``DefaultModelLoader.load_weights``
(its weight iterator, the model's ``load_weights``, its own "weights not initialized" check).
``process_weights_after_loading`` (repacking into GPU kernel layouts) is not run: the check reads
the parameters as the loader left them.

Every patch is in ``PATCHES`` / ``apply_patches`` below, with why it is safe. None touches config
parsing, ``load_weights``, weight loaders, quant methods' ``create_weights`` or parameter classes.
"""

from __future__ import annotations

import re
import time

import runner_common as rc
import torch

#: Parameters vLLM legitimately leaves unwritten by a checkpoint (regex on the parameter name, why).
OPTIONAL = [
    (r"\.(k|v|q|prob)_scale$", "KV-cache/attention quantization scale: vLLM sets 1.0 when a checkpoint has none"),
    (r"\.attn\.(k|v|q)_zero_point$",
     "KV-cache zero point: vLLM's CompressedTensorsKVCacheMethod.create_weights (quantization/compressed_tensors/"
     "compressed_tensors.py) registers k/v/q_zero_point on every attention layer 'to enable loading of "
     "llm-compressor checkpoints which contain them'; vLLM uses none (symmetric only) and process_weights_after_"
     "loading deletes them; a checkpoint without kv_cache_scheme has none"),
]

def optional_for(model) -> list[tuple[str, str]]:
    """Parameters optional for this model as vLLM built it (decided from its own quant methods)."""
    out = []
    for name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if type(getattr(qm, "fmt", None)).__name__ == "_DropInputScale" and hasattr(module, "input_scale"):
            out.append((rf"^{re.escape(name)}\.input_scale$",
                        "weight-only (W4A16) NVFP4 layer: vLLM's _DropInputScale registers input_scale only to accept "
                        "older checkpoints that carry one, and deletes it after loading"))
        if type(qm).__name__ == "CompressedTensorsW4A4Nvfp4MoEMethod" and getattr(qm, "use_a16", False):
            why = ("NVFP4A16 experts: vLLM's CompressedTensorsW4A4Nvfp4MoEMethod.create_weights registers "
                   "w13/w2_input_global_scale for every NVFP4 MoE; an NVFP4A16 checkpoint has none (llm-compressor "
                   "writes input_global_scale only for static activations: compressed_tensors' "
                   "NVFP4PackedCompressor.compression_param_names); process_weights_after_loading passes them, "
                   "with use_a16, to the GPU backend's layout conversion (fused_moe/oracle/nvfp4.py: "
                   "convert_to_nvfp4_moe_kernel_format), not run here")
            for pname in ("w13_input_global_scale", "w2_input_global_scale"):
                if hasattr(module, pname):
                    out.append((rf"^{re.escape(name)}\.{pname}$", why))
        out.extend(_a16_moe_input_scales(name, module, qm))
        pad = getattr(module, "in_proj_padding", 0)
        proj = getattr(module, "in_proj_qkvgfab", None)
        if pad and proj is not None:
            why = (f"alignment padding of {name}.in_proj_qkvgfab ({pad} rows, kda.py in_proj_padding): no checkpoint "
                   "shard maps there; vLLM zeroes the padding weight rows after loading and never reads their scales")
            for pname, p in proj.named_parameters():
                if pname == "weight_scale" and p.dim() == 2:
                    out.append((rf"^{re.escape(name)}\.in_proj_qkvgfab\.weight_scale$", why, pad * p.shape[1]))
                elif pname in ("weight_scale_2", "input_scale") and p.dim() == 1:
                    out.append((rf"^{re.escape(name)}\.in_proj_qkvgfab\.{pname}$", why, 1))
        out.extend(_hyper_connection_padding(name, module))
        out.extend(_ngram_padding(name, module))
    return out


#: The NVFP4 MoE backends whose branch of vLLM 0.33's ``fused_moe/oracle/nvfp4.py``
#: ``convert_to_nvfp4_moe_kernel_format`` sets ``a13_scale = None`` / ``a2_scale = None`` (their weight-only kernels
#: take no activation scale): the backends that take ModelOpt's weight-only experts (``select_nvfp4_moe_backend`` with
#: ``activation_key=None``: Marlin's ``_supports_quant_scheme`` checks the weight only, Humming lists
#: ``(kNvfp4Static, None)``; the FlashInfer / CUTLASS ones need an activation key).
A16_MOE_BACKENDS = ("MARLIN", "HUMMING")


def _a16_moe_input_scales(name: str, module, qm) -> list[tuple[str, str]]:
    """ModelOpt weight-only NVFP4 experts (``ModelOptNvFp4FusedMoE`` with ``use_a16``: ``quant_algo`` ``W4A16_NVFP4``,
    modelopt.py ``ModelOptNvFp4FusedMoE.__init__``): ``create_weights`` registers ``w13_input_scale`` /
    ``w2_input_scale`` for every NVFP4 MoE, and the backend vLLM picks for it drops them unread
    (``A16_MOE_BACKENDS``); so a checkpoint without them (Step-3 text's loader cannot take one) leaves them unset."""
    if type(qm).__name__ != "ModelOptNvFp4FusedMoE" or not getattr(qm, "use_a16", False):
        return []
    backend = getattr(getattr(qm, "nvfp4_backend", None), "name", None)
    if backend not in A16_MOE_BACKENDS:
        return []
    why = (f"W4A16_NVFP4 experts: vLLM's ModelOptNvFp4FusedMoE.create_weights registers w13/w2_input_scale for every "
           f"NVFP4 MoE; under use_a16 it picks the {backend} backend, whose branch of fused_moe/oracle/nvfp4.py: "
           "convert_to_nvfp4_moe_kernel_format sets a13_scale / a2_scale to None (weight-only: never read)")
    return [(rf"^{re.escape(name)}\.{pname}$", why) for pname in ("w13_input_scale", "w2_input_scale")
            if hasattr(module, pname)]


def _ngram_padding(name: str, module) -> list[tuple[str, str, int]]:
    """LongCat-Flash-Lite's n-gram tables: vLLM's ``NgramEmbedding`` (models/longcat_flash_ngram.py) concatenates them
    into one ``VocabParallelEmbedding`` (``oe_embedder``), padded to its row multiple past ``_offsets[-1]``, and its
    ``load_weight`` writes each table's rows at its offset, never the padding rows."""
    offsets, emb = getattr(module, "_offsets", None), getattr(module, "oe_embedder", None)
    if not offsets or emb is None or emb.weight.dim() != 2 or emb.weight.shape[0] <= offsets[-1]:
        return []
    return [(rf"^{re.escape(name)}\.oe_embedder\.weight$", "LongCat-Flash-Lite NgramEmbedding: oe_embedder's padding "
             "rows past its n-gram tables' offsets, which load_weight never writes",
             (emb.weight.shape[0] - offsets[-1]) * emb.weight.shape[1])]


def loadable_buffers(model) -> set[str]:
    """The buffers vLLM's loader fills from a checkpoint tensor of the same name: the persistent ones. Its
    ``AutoWeightsLoader._load_module`` (model_executor/models/utils.py) offers a module's tensors to its parameters
    and to what ``_add_loadable_non_param_tensors`` adds, "persistent registered buffers. Non-persistent buffers are
    excluded, matching PyTorch state_dict()" (Gemma4's ``layer_scalar``: gemma4.py ``register_buffer``); a
    checkpoint tensor written into a non-persistent buffer stays skipped."""
    return rc.persistent_buffers(model)


def _hyper_connection_padding(name: str, module) -> list[tuple[str, str, int]]:
    """Qwen3.8-Flash-Next's hyper-connection: vLLM packs input_mix_weight_down and block_inject_weight into one
    MergedColumnParallelLinear padded to 16 rows (models/qwen4_exp/nvidia/hyperconnection.py ``pad_size``, shard
    ``_input_mix_padding``, which no checkpoint tensor maps to); the padding rows' outputs are split off and dropped
    (``_down_and_inject``)."""
    pad = getattr(module, "pad_size", 0)
    proj = getattr(module, "input_mix_weight_down_block_inject", None)
    if not pad or proj is None:
        return []
    why = (f"alignment padding of {name}.input_mix_weight_down_block_inject ({pad} rows, hyperconnection.py pad_size): "
           "no checkpoint tensor maps there; their outputs are split off and dropped (_down_and_inject)")
    return [(rf"^{re.escape(name)}\.input_mix_weight_down_block_inject\.weight$", why, pad * proj.weight.shape[1])]


def mtp_rule(config):
    """vLLM's own rule for the MTP layers a main model drops: ``get_spec_layer_idx_from_weight_name``
    (model_executor/models/utils.py), which ``skip_spec_layers`` applies in load_weights (GLM-4.5:
    glm4_moe.py Glm4MoeModel.load_weights); the MTP model (glm4_moe_mtp.py Glm4MoeMTP) loads those."""
    from vllm.model_executor.models.utils import get_spec_layer_idx_from_weight_name

    minimax_m3, longcat = minimax_m3_mtp_rule(config), longcat_mtp_rule(config)
    inkling = rc.is_inkling(config)

    def why(name: str) -> str | None:
        if (block := minimax_m3(name) or longcat(name)) is not None:  # an MTP block of its own naming
            return block
        if name.startswith("mtp.") and getattr(config, "mtp_num_hidden_layers", 0):
            return ("MTP block (mtp_num_hidden_layers): vLLM's main model maps 'mtp.' to None "
                    "(models/qwen3_5.py Qwen3_5ForConditionalGeneration.hf_to_vllm_mapper); its MTP model "
                    "(qwen3_5_mtp.py Qwen3_5MoeMTP) loads it")
        if name.startswith("mtp.") and getattr(config, "model_type", None) == "deepseek_v4" \
                and getattr(config, "num_nextn_predict_layers", 0):
            return ("MTP layer (num_nextn_predict_layers): vLLM's DeepSeek V4 main model maps 'mtp.' to None "
                    "(models/deepseek_v4/nvidia/model.py _make_deepseek_v4_weights_mapper); its MTP model "
                    "(models/deepseek_v4/nvidia/mtp.py DeepSeekV4MTP) loads it")
        if rc.is_mimo_v2(config):  # MiMo-V2's MTP layers are model.mtp.layers.{i}, never model.layers.{n}
            if not name.startswith("model.mtp.layers."):
                return None
            return ("MTP layer (model.mtp.layers.*): vLLM's MiMo-V2 main model skips every name holding 'mtp' "
                    "(models/mimo_v2.py MiMoV2Model.load_weights); its MTP model (mimo_v2_mtp.py MiMoV2MTP) loads it")
        if inkling and name.startswith("model.mtp."):
            return ("MTP head (model.mtp.*): vLLM's Inkling main model maps 'model.mtp.' to None "
                    "(models/inkling/nvidia/model.py _load_inkling_weights); its MTP model (nvidia/mtp.py InklingMTP) "
                    "loads it")
        layer = get_spec_layer_idx_from_weight_name(config, name)
        if layer is None:
            return None
        return (f"MTP layer {layer} (num_nextn_predict_layers): vLLM's main model drops it "
                "(models/utils.py get_spec_layer_idx_from_weight_name via skip_spec_layers); its MTP model loads it")
    return why


def draft_rule(config):
    """The draft's side of the same rule: a checkpoint tensor the MTP rule does not assign to an MTP layer is the
    main model's, and the draft drops it (glm4_moe_mtp.py Glm4MoeMTP.load_weights and deepseek_mtp.py
    DeepSeekMTP.load_weights ``continue`` where ``get_spec_layer_idx_from_weight_name`` finds no MTP layer;
    qwen3_5_mtp.py Qwen3_5MTP maps every name outside ``mtp.`` away)."""
    mtp = mtp_rule(config)

    def why(name: str) -> str | None:
        if mtp(name):
            if rc.is_mimo_v2(config) and not name.startswith("model.mtp.layers.0."):
                return ("a MiMo-V2 MTP layer after the first: vLLM's draft builds one (models/mimo_v2_mtp.py "
                        "_MIMO_V2_FLASH_NUM_MTP_LAYERS = 1; config/speculative.py 'vLLM currently supports only the "
                        "first MiMo-V2 MTP layer'), its load_weights drops names it has no parameter for")
            return None
        return "the main model's tensor (no MTP layer by vLLM's own rule): its draft model drops it on purpose"
    return why


def _draft_config(model, mc):
    """The config the draft's own ``load_weights`` classifies names with: the model's ``config`` (GLM-4.7-Flash's
    Glm4MoeLiteMTP reads the target's, ``vllm_config.model_config.hf_config``, num_hidden_layers as stored, while the
    draft config's override sets num_hidden_layers 0: config/speculative.py hf_config_override), where it counts MTP
    layers; else the draft config's text config."""
    own = getattr(model, "config", None)
    text = own.get_text_config() if hasattr(own, "get_text_config") else own
    if text is not None and getattr(text, "num_nextn_predict_layers", None) and hasattr(text, "num_hidden_layers"):
        return text
    return mc.hf_text_config


def minimax_m3_mtp_rule(config):
    """MiniMax M3's MTP modules (``language_model.model.mtp.layers.{i}.*``, i < ``num_mtp_modules``): vLLM's
    main model skips every name with ``mtp.`` in it (vllm/models/minimax_m3/nvidia/model.py
    MiniMaxM3Model.load_weights, "The MTP module is not modeled yet"); its MTP model (registry ``MiniMaxM3MTP``,
    nvidia/mtp.py MiniMaxM3MTP._map_checkpoint_name) loads them."""
    n = getattr(config, "num_mtp_modules", 0) or 0

    def why(name: str) -> str | None:
        m = re.match(r"(?:language_model\.)?model\.mtp\.layers\.(\d+)\.", name)
        if not (n > 0 and m and int(m.group(1)) < n):
            return None
        return (f"MTP module {m.group(1)} (num_mtp_modules): vLLM's main model skips names with 'mtp.' "
                "(models/minimax_m3/nvidia/model.py MiniMaxM3Model.load_weights); its MTP model MiniMaxM3MTP loads it")
    return why


def longcat_mtp_rule(config):
    """LongCat-Flash's MTP layer (``model.mtp.*``; the config holds no count: vLLM's draft builds one layer): vLLM's
    main model skips names starting ``mtp.`` (longcat_flash.py ``LongcatFlashForCausalLM.load_weights``, "The MTP
    layers are loaded by LongCatFlashMTP"); its draft loads every name holding ``model.mtp``
    (longcat_flash_mtp.py ``LongCatFlashMTP.get_spec_layer_idx_from_weight_name``)."""
    longcat = bool({"LongcatFlashForCausalLM", "LongcatFlashNgramForCausalLM"}
                   & set(getattr(config, "architectures", None) or ()))

    def why(name: str) -> str | None:
        if not (longcat and name.startswith("model.mtp.")):
            return None
        return ("MTP layer (model.mtp.): vLLM's LongCat main model skips names starting 'mtp.' (longcat_flash.py "
                "LongcatFlashForCausalLM.load_weights); its draft LongCatFlashMTP loads them")
    return why


#: Every patch, with why it is safe (docs/engine-checks.md lists the same).
PATCHES = [
    ("platform",
     "current_platform is vLLM's own CudaPlatform class with the device queries answered as one B200 "
     "(capability 10.0, name, memory, count 1): the engine picks the Blackwell code paths; no loading code "
     "is changed"),
    ("torch.cuda streams/events",
     "torch.cuda.Stream/Event (and current/default stream) made in constructors return inert objects: they only "
     "order kernels at run time, never hold weights"),
    ("torch.cuda device queries",
     "torch.cuda.current_device/set_device/get_device_capability/get_device_properties/device_count answer "
     "for the presented B200: queries only"),
    ("cuda allocations on the CPU",
     "a TorchFunctionMode rewrites an explicit device='cuda' (and .cuda()/.to('cuda')) to the CPU; values, "
     "dtypes and shapes are unchanged"),
    ("distributed",
     "a single-process gloo group (world size 1, TP=1) through vLLM's own init_distributed_environment and "
     "initialize_model_parallel; no collective moves weights at TP=1"),
    ("workspace manager",
     "vLLM's own init_workspace_manager(cpu) runs before the model is built, as its GPU worker does before "
     "making the model runner (v1/worker/gpu_worker.py _init_workspace_and_model_runner): attention backends that "
     "reserve scratch in their constructors (MLA prefill trtllm_ragged, DSA) get it; scratch holds no weights"),
    ("weight iterator observed",
     "DefaultModelLoader.get_all_weights is wrapped to record each (name, tensor) it yields, unchanged"),
    ("engram tables on the device",
     "for a model with n-gram embedding tables (Qwen3.8-Flash-Next's PLE), EngramConfig.cpu_offload (on by default: "
     "the table in pinned host memory read through UVA, which a CPU without CUDA cannot give) is turned off, as "
     "--engram-config '{\"cpu_offload\": false}' does: the table is then the parent class of the offloaded one "
     "(models/qwen4_exp/common/ngram_embedding.py Qwen4ExpPLEEmbedding), with the same parameter and weight loader"),
]


def engram_on_device(vllm_config) -> None:
    """The "engram tables on the device" patch (PATCHES): applied only where vLLM resolved an EngramConfig
    (config/vllm.py _resolve_and_verify_engram_config: models with n-gram layers)."""
    engram = getattr(vllm_config, "engram_config", None)
    if engram is not None and engram.cpu_offload:
        engram.cpu_offload = False


def apply_patches(result: dict) -> None:
    props = rc.patch_torch_cuda(rc.CAPABILITY, rc.DEVICE_NAME, rc.DEVICE_MEMORY, available=False)

    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class PresentedBlackwell(CudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(*rc.CAPABILITY)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return rc.DEVICE_NAME

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return rc.DEVICE_MEMORY

        @classmethod
        def get_device_uuid(cls, device_id: int = 0) -> str:
            return props.uuid

        @classmethod
        def device_count(cls) -> int:
            return 1

        @classmethod
        def is_fully_connected(cls, physical_device_ids) -> bool:
            return True

        @classmethod
        def set_device(cls, device) -> None:
            return None

        @classmethod
        def get_device_numa_node(cls, device_id: int = 0):
            return None

        @classmethod
        def get_all_device_numa_nodes(cls):
            return None

        @classmethod
        def is_pin_memory_available(cls) -> bool:
            return False

    platforms._current_platform = PresentedBlackwell()
    platforms.current_platform = platforms._current_platform
    result["patches"] = [name for name, _ in PATCHES]


#: vLLM imports a model's module when its registry resolves the architecture: the families the tool converts.
MODEL_MODULES = ("deepseek_v2", "deepseek_mtp", "kimi_linear", "kimi_k3", "qwen3_moe", "glm4_moe", "glm4_moe_mtp",
                 "gpt_oss", "minimax_m2", "qwen3_next", "qwen3_5", "qwen3_5_mtp")


def preload() -> None:
    """What ``run`` starts with (the patches, then vLLM's imports), and the model, quantization and numeric-check
    modules a check imports next: done once by the fork server (``zygote.py``)."""
    apply_patches({})
    rc.import_all(["vllm.config", "vllm.distributed", "vllm.engine.arg_utils", "vllm.model_executor.model_loader",
                   "vllm.utils.torch_utils", "vllm.config.speculative",
                   *(f"vllm.model_executor.models.{m}" for m in MODEL_MODULES),
                   "vllm.model_executor.layers.quantization.modelopt", "vllm.model_executor.layers.quantization.fp8",
                   "vllm.model_executor.layers.quantization.mxfp4",
                   "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
                   "runner_numerics"])


def _init_workspace() -> None:
    """See PATCHES ("workspace manager")."""
    from vllm.v1.worker.workspace import init_workspace_manager

    init_workspace_manager(torch.device("cpu"))


def from_target(model) -> list[tuple[str, str, str]]:
    """The draft's parameters vLLM's proposer replaces with the target model's after loading the draft
    (v1/spec_decode/llm_base_proposer.py: ``_maybe_share_embeddings`` takes the target's ``embed_tokens`` for an MTP
    draft, ``_maybe_share_lm_head`` its ``lm_head``, also as every MTP layer's ``shared_head.head``): what the draft
    does not need from the checkpoint; anything it does load into them must still load."""
    why = ("taken from the target model: vLLM's proposer (v1/spec_decode/llm_base_proposer.py "
           "{fn}) replaces it with the target's {what} after the draft is loaded")
    out = []
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "embed_tokens") and not hasattr(model, "has_own_embed_tokens"):
        out.append((r"^model\.embed_tokens\.", why.format(fn="_maybe_share_embeddings", what="embed_tokens"),
                    "embed_tokens"))
    if not hasattr(model, "has_own_lm_head"):
        out.append((r"^lm_head\.", why.format(fn="_maybe_share_lm_head", what="lm_head"), "lm_head"))
        out.append((r"^model\.layers\.\d+\.shared_head\.head\.",
                    why.format(fn="_maybe_share_lm_head", what="lm_head (as shared_head.head)"), "lm_head"))
    return out


def mtp_layers(config) -> int:
    """How many MTP layers the config announces (the speculative tokens a deployment asks for: one a layer)."""
    text = getattr(config, "text_config", None) or config
    for c in (config, text):
        for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules"):
            n = getattr(c, key, None)
            if isinstance(n, int) and n > 0:
                return n
    return 1


def engine_config(model_dir: str, draft: bool, trust_remote_code: bool = False):
    """vLLM's own config for the checkpoint: with ``draft``, as a deployment asks for its MTP draft
    (``--speculative-config '{"method": "mtp", "num_speculative_tokens": N}'``), and then the draft's config the
    proposer builds it with (llm_base_proposer.py ``_get_model``: ``_create_draft_vllm_config``, the speculative
    config's ``draft_model_config``, ``get_draft_load_config``). Returns (vllm_config, model_config, load_config)."""
    from dataclasses import replace

    from vllm.engine.arg_utils import EngineArgs

    kw = dict(model=model_dir, tensor_parallel_size=1, enforce_eager=True, load_format="safetensors",
              max_model_len=4096, trust_remote_code=trust_remote_code)  # as vLLM's own flag
    if not draft:
        vc = EngineArgs(**kw).create_engine_config()
        return vc, vc.model_config, vc.load_config
    from transformers import AutoConfig

    n = mtp_layers(AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code))
    vc = EngineArgs(**kw, speculative_config={"method": "mtp", "num_speculative_tokens": n}).create_engine_config()
    spec = vc.speculative_config
    vc = replace(vc, attention_config=replace(vc.attention_config, backend=spec.attention_backend))
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    return vc, spec.draft_model_config, get_draft_load_config(vc)


def run(model_dir: str, result: dict) -> None:
    t0 = time.perf_counter()
    result["phase"] = "import"
    apply_patches(result)
    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    result["version"] = vllm.__version__
    result["timings"]["import_s"] = round(time.perf_counter() - t0, 2)
    from vllm.model_executor.models.registry import ModelRegistry

    result["registered"] = rc.registered(model_dir, ModelRegistry.get_supported_archs())

    result["phase"] = "config"
    t = time.perf_counter()
    with rc.CpuDevices():
        vllm_config, mc, load_config = engine_config(model_dir, result["draft"], result.get("trust_remote_code", False))
        engram_on_device(vllm_config)
    result["architectures"] = list(getattr(mc.hf_config, "architectures", None) or [])
    result["quantization"] = mc.quantization
    result["quant_config"] = type(vllm_config.quant_config).__name__ if vllm_config.quant_config else None
    result["timings"]["config_s"] = round(time.perf_counter() - t, 2)

    result["phase"] = "init"
    t = time.perf_counter()
    loader = get_model_loader(load_config)
    prefixes = rc.watch_prefixes(vllm_config.quant_config) if result["derive"] else None
    with set_current_vllm_config(vllm_config), rc.CpuDevices():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{rc.free_port()}")
        initialize_model_parallel(1, 1)
        _init_workspace()
        with set_default_torch_dtype(mc.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=vllm_config, model_config=mc)
    result["model_class"] = f"{type(model).__module__}.{type(model).__qualname__}"
    result["timings"]["init_s"] = round(time.perf_counter() - t, 2)
    if result["derive"]:
        result["modules"] = rc.describe(model, prefixes)
        if result["derive"] == "build":
            result["phase"] = "done"
            return
    load(result, vllm_config, mc, loader, model)


def unmapped_renames(model_class, offered: list[str]) -> dict[str, str]:
    """Source module -> the module vLLM loads its weight into, where the class's ``hf_to_vllm_mapper`` renames the
    weight (``layers.0.attention.wq_b.weight`` -> ``model.layers.0.self_attn.q_b_proj.weight``) but not the module's
    own name, which is what an exclude list holds, so that the entry no longer names the layer: vLLM 0.33
    model_loader/utils.py ``configure_quant_config`` hands the quant config ``hf_to_vllm_mapper.get_rename_mapper()``,
    ModelOpt's ``apply_vllm_mapper`` maps the exclude entries with it, and ``ModelOptQuantConfigBase.is_layer_excluded``
    takes an entry found anywhere in the layer's name (its loosest test: ``lm_head`` names
    ``language_model.lm_head``, ``head`` names ``lm_head``). A regex anchored on the parameter's suffix
    (models/mistral_large_3.py ``MistralLarge3ForCausalLM.hf_to_vllm_mapper``) leaves ``layers.1.gate`` as written,
    which is nowhere in ``model.layers.1.mlp.gate``: the layer is built quantized. The table then names such modules
    in the engine's spelling too (``[engine_names]``)."""
    mapper = getattr(model_class, "hf_to_vllm_mapper", None)
    if mapper is None:
        return {}
    names = mapper.get_rename_mapper()
    out = {}
    for tensor in offered:
        if not tensor.endswith(".weight"):
            continue
        module = tensor.removesuffix(".weight")
        mapped = names.map_name(tensor)
        if mapped is None or not mapped.endswith(".weight") or mapped.removesuffix(".weight") == module:
            continue
        target = mapped.removesuffix(".weight")
        if (names.map_name(module) or module) not in target:
            out[module] = target
    return out


def load(result: dict, vllm_config, mc, loader, model) -> None:
    """vLLM's own weight loading of ``model`` under the load observer, then the check (and the numeric read)."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    result["phase"] = "load"
    t = time.perf_counter()
    tracker = rc.Tracker()
    tracker.arm(model, loadable_buffers(model))
    inner = loader.get_all_weights
    if result["weights_spec"]:
        def inner(model_config, m):
            return rc.spec_weights(result["weights_spec"])
    loader.get_all_weights = lambda model_config, m: tracker.weights(inner(model_config, m))
    error = None
    try:
        with set_current_vllm_config(vllm_config), rc.CpuDevices(), set_default_torch_dtype(mc.dtype), tracker.mode():
            loader.load_weights(model, mc)
    except Exception as e:
        error = e
    result["timings"]["load_s"] = round(time.perf_counter() - t, 2)
    result["phase"] = "check"
    if result["draft"]:
        rule = draft_rule(_draft_config(model, mc))
        result.update(tracker.result(model, OPTIONAL + optional_for(model), main_rule=rule, target=from_target(model)))
    else:
        result.update(tracker.result(model, OPTIONAL + optional_for(model), mtp_rule(mc.hf_text_config)))
    if result["derive"]:
        result["spans"] = rc.spans(tracker)
        result["renames"] = unmapped_renames(type(model), [s["tensor"] for s in result["spans"]])
    with set_current_vllm_config(vllm_config), rc.CpuDevices(), set_default_torch_dtype(mc.dtype):
        rc.numerics("vllm", result, model, tracker, error)
    rc.finish(result, error, tracker)


if __name__ == "__main__":
    rc.main("vllm", run)
