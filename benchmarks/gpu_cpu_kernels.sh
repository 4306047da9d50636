#!/bin/bash
# Issue 14, C kernels second pass, on the H200 machine's CPUs (one device call): the C kernels equal the torch code
# there, where the time goes (cpu_pool_probe.py), the floor table after and before (the previous tree, given as
# BEFORE=folder holding it, run with this tree's recipe_kernels.py). Logs go to $OUT.
set -u
OUT=${OUT:-benchmarks/results/cpu-kernels}
mkdir -p "$OUT"
{ nproc; lscpu; free -g; cc --version | head -1; python3 -c "import torch; print(torch.__version__)"; uptime
} > "$OUT/machine.log" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1
export KIMI_CONVERT_CACHE=/tmp/kc-cache-after
python3 benchmarks/cpu_kernels_check.py 2>&1 | tee "$OUT/check.log"
python3 benchmarks/cpu_pool_probe.py 2>&1 | tee "$OUT/probe.log"
python3 benchmarks/recipe_kernels.py --device cpu --torch-reps 1 2>&1 | tee "$OUT/bench-cpu16-after.log"
cp "$OUT/recipe_kernels_cpu.json" "$OUT/recipe_kernels_cpu_after.json" 2>/dev/null
if [ -n "${BEFORE:-}" ]; then
    cp benchmarks/recipe_kernels.py "$BEFORE/benchmarks/recipe_kernels.py"
    (cd "$BEFORE" && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install-before.log" 2>&1
     KIMI_CONVERT_CACHE=/tmp/kc-cache-before python3 benchmarks/recipe_kernels.py --device cpu --torch-reps 1 2>&1 \
         | tee "$OUT/bench-cpu16-before.log")
    cp "$OUT/recipe_kernels_cpu.json" "$OUT/recipe_kernels_cpu_before.json" 2>/dev/null
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
fi
uptime >> "$OUT/machine.log"
