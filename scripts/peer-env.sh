#!/usr/bin/env bash
# Create llm-compressor's own virtual environment (the peer the compressed-tensors output is compared with:
# benchmarks/compare_llmcompressor.py, benchmarks/ct_speed.py, tests/test_compressed_tensors.py and the peer
# test of tests/test_engines.py). Idempotent. Never a dependency of the tool itself.
#
#   scripts/peer-env.sh                 KIMI_CONVERT_LLMC_PYTHON's env, default /work/peers/llmc
# Measured: 1.5 GB installed, 69 s on 2 cores (`/usr/bin/time bash scripts/peer-env.sh`, a fresh environment).
set -uo pipefail
LLMC_VERSION=0.14.0.1
env="${KIMI_CONVERT_LLMC_ENV:-/work/peers/llmc}"
python="${PYTHON:-python3}"
if [ -x "$env/bin/python" ] && "$env/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('llmcompressor') != '$LLMC_VERSION')" 2>/dev/null; then
    echo "llmcompressor $LLMC_VERSION: ready at $env"; exit 0
fi
rm -rf "$env.partial"
"$python" -m venv "$env.partial" || exit 1
# a CPU build of torch (the pinned one the tool uses), then llm-compressor
"$env.partial/bin/python" -m pip install -q torch==2.13.0 "llmcompressor==$LLMC_VERSION" >"$env.log" 2>&1 || {
    echo "llmcompressor: pip failed, see $env.log"; exit 1; }
rm -rf "$env" && mv "$env.partial" "$env" && echo "llmcompressor $LLMC_VERSION: ready at $env"
