#!/bin/bash
# NVFP4 kernels on the H200 machine (session 7, one device call): the C kernel's AVX-512 row against the AVX2 row
# (KIMI_CONVERT_CPU_ISA=avx2) on the CPUs, the Triton quantize kernel's tile orders on the GPU (--orders). The
# equality checks are tests: `TRITON_INTERPRET= python3 -m pytest -m gpu` (tests/test_gpu*.py). Logs and JSON go
# to $OUT.
set -u
OUT=${OUT:-benchmarks/results/h200-kernels}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1
{ nproc; lscpu; cc --version | head -1; nvidia-smi -L
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/machine.log" 2>&1
export KIMI_CONVERT_CACHE=/tmp/kc-cache PYTHONUNBUFFERED=1
for isa in default avx2; do
  KIMI_CONVERT_CPU_ISA=$isa OUT=$OUT python3 benchmarks/recipe_kernels.py --device cpu --kernels nvfp4 2>&1 \
      | tee "$OUT/cpu-$isa.log"
  mv "$OUT/recipe_kernels_cpu.json" "$OUT/recipe_kernels_cpu_$isa.json"
done
OUT=$OUT python3 benchmarks/recipe_kernels.py --device cuda --kernels nvfp4 --orders 2>&1 | tee "$OUT/cuda-orders.log"
