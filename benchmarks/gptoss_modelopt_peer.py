"""NVIDIA Model Optimizer's own MXFP4 -> NVFP4 cast of a gpt-oss checkpoint, run as its ``hf_ptq.py
--qformat nvfp4_experts_only --cast_mxfp4_to_nvfp4`` runs it, on the CPU: the peer of
``benchmarks/compare_gptoss_cast.py`` (and of ``tests/test_gptoss_cast.py``). Run with a python that has
``nvidia-modelopt`` and ``transformers`` (``scripts/gptoss-peer-env.sh`` makes one); nothing here imports
kimi-convert.

    python benchmarks/gptoss_modelopt_peer.py --modelopt-repo M --input SRC --output OUT

The steps are hf_ptq.py's for this flag (``examples/hf_ptq/hf_ptq.py``, the ``--cast_mxfp4_to_nvfp4``
branches), calling the peer's own module ``examples/hf_ptq/cast_mxfp4_to_nvfp4.py`` from the checkout:

1. load the model dequantized to BF16 ``GptOssExperts`` (``Mxfp4Config(dequantize=True)``, as hf_ptq's
   ``get_model``);
2. the ``nvfp4_experts_only`` config with the peer's ``force_weight_quantizers_static`` applied to it;
3. ``mtq.quantize`` with a forward loop over a few token batches (hf_ptq calibrates on a data set: here
   fixed random tokens, so nothing is downloaded; they set only the activation scales, never the weights'
   cast, which the peer's ``apply_to_model`` overwrites from the source's scales);
4. the peer's ``apply_to_model(model, SRC)`` (it prints its lossless-block count);
5. ``export_hf_checkpoint``: ModelOpt's unified HF export, as hf_ptq's ``post_quantize`` / export.

The model's config is loaded with ``pad_token_id`` / ``eos_token_id`` cleared: the synthetic presets keep the
release's ids with a small vocabulary, which ``nn.Embedding`` refuses as a padding index; no weight depends on
them.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modelopt-repo", required=True, type=Path, help="a checkout with examples/hf_ptq/")
    ap.add_argument("--input", required=True, type=Path)
    ap.add_argument("--output", required=True, type=Path)
    ap.add_argument("--calib-batches", type=int, default=4)
    a = ap.parse_args()
    sys.path.insert(0, str(a.modelopt_repo / "examples" / "hf_ptq"))
    import modelopt.torch.quantization as mtq
    import torch
    from cast_mxfp4_to_nvfp4 import apply_to_model, force_weight_quantizers_static  # the peer's own module
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(a.input)
    cfg.pad_token_id = cfg.eos_token_id = None
    model = AutoModelForCausalLM.from_pretrained(a.input, config=cfg, quantization_config=Mxfp4Config(dequantize=True),
                                                 dtype=torch.bfloat16, device_map="cpu").eval()
    quant_cfg = copy.deepcopy(mtq.NVFP4_EXPERTS_ONLY_CFG)
    force_weight_quantizers_static(quant_cfg["quant_cfg"])
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(a.calib_batches)]

    def forward_loop(m):
        with torch.no_grad():
            for b in batches:
                m(input_ids=b)

    model = mtq.quantize(model, quant_cfg, forward_loop)
    apply_to_model(model, a.input)
    with torch.no_grad():
        export_hf_checkpoint(model, export_dir=str(a.output))
    print(f"[gptoss_modelopt_peer] exported {a.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
