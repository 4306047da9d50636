#!/usr/bin/env bash
# Everything that needs the GPU, in one device call (H200): the test suite with the Triton kernel
# compiled, large-tensor equality, whole packs --device cuda vs --device cpu, and the benchmarks.
#   bash benchmarks/gpu_check.sh        (writes logs under $OUT when set)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || python3 -m pip install --no-deps --no-build-isolation --no-index -e .
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
echo "== pytest (Triton compiled for the GPU)"
python3 -m pytest tests -q -x -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/pytest.log"
echo "== large-tensor equality and whole packs"
python3 benchmarks/gpu_equality.py 2>&1 | tee "$OUT/equality.log"
echo "== kernel benchmark"
python3 benchmarks/nvfp4_bench.py --device cuda 2>&1 | grep -v -i warn | tee "$OUT/bench.log"
