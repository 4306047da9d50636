#!/usr/bin/env bash
# Create the environment NVIDIA Model Optimizer's gpt-oss MXFP4 -> NVFP4 cast runs in (the peer of
# benchmarks/compare_gptoss_cast.py and tests/test_family_gpt_oss.py::test_byte_identical_to_modelopts_own_cast):
# nvidia-modelopt (the tests' pinned version), transformers (GptOssForCausalLM, Mxfp4Config), a CPU torch.
# Idempotent. Never a dependency of the tool itself. The peer's script comes from a Model Optimizer checkout
# (KIMI_CONVERT_MODELOPT_REPO: a folder with examples/hf_ptq/cast_mxfp4_to_nvfp4.py).
#
#   scripts/gptoss-peer-env.sh          KIMI_CONVERT_PEER_ENV, default .venv-peer in the repository
set -uo pipefail
MODELOPT_VERSION=0.47.0
TRANSFORMERS_VERSION=5.24.0
env="${KIMI_CONVERT_PEER_ENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv-peer}"
python="${PYTHON:-python3}"
if [ -x "$env/bin/python" ] && "$env/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('nvidia-modelopt') != '$MODELOPT_VERSION' or m.version('transformers') != '$TRANSFORMERS_VERSION')" 2>/dev/null; then
    echo "gpt-oss peer (nvidia-modelopt $MODELOPT_VERSION, transformers $TRANSFORMERS_VERSION): ready at $env"; exit 0
fi
rm -rf "$env.partial"
"$python" -m venv "$env.partial" || exit 1
"$env.partial/bin/python" -m pip install -q torch==2.13.0 "nvidia-modelopt==$MODELOPT_VERSION" \
    "transformers==$TRANSFORMERS_VERSION" accelerate requests >"$env.log" 2>&1 || {
    echo "gpt-oss peer: pip failed, see $env.log"; exit 1; }
rm -rf "$env" && mv "$env.partial" "$env" && echo "gpt-oss peer: ready at $env"
