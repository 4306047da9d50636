#!/bin/bash
# Issue 10 on a GPU machine: every recipe's output is the same, byte for byte, whether pack computes on
# the GPU (--device cuda) or on the CPU, for the tiny presets and for bench-k3 (real-width MXFP4 experts,
# real-width attention for block FP8), and what each takes. Logs go to $OUT (or benchmarks/results/gpu-recipes).
set -u
OUT=${OUT:-benchmarks/results/gpu-recipes}
W=${WORK:-/tmp/kc}
mkdir -p "$OUT" "$W"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1
{ nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/machine.log" 2>&1
{
for preset in tiny-k3 tiny-kimi-linear bench-k3; do
    kimi-convert synth "$preset" "$W/$preset" --overwrite > /dev/null
    recipes="nvfp4-w4a16"
    case $preset in *k3) recipes="nvidia-k3 nvfp4-w4a16" ;; esac
    for r in $recipes; do
        for d in cpu cuda; do
            /usr/bin/time -f "$preset $r $d: %e s, %M KB max RSS" \
                kimi-convert pack "$W/$preset" "$W/$preset-$r-$d" -q --recipe "$r" --device "$d" --overwrite
        done
        if diff -r "$W/$preset-$r-cpu" "$W/$preset-$r-cuda" > /dev/null; then
            echo "IDENTICAL: $preset $r cpu == cuda, every file"
        else
            echo "DIFFERENT: $preset $r cpu != cuda"; diff -rq "$W/$preset-$r-cpu" "$W/$preset-$r-cuda"
        fi
    done
done
} 2>&1 | tee "$OUT/recipes.log"
