#!/usr/bin/env bash
# pack of the Qwen3 MoE, GLM-4.5, MiniMax-M2, Qwen3.5 MoE, DeepSeek V3 (FP8 source) and gpt-oss (MXFP4 banks, cast) bench presets at real width (docs/families.md), against the disk floor,
# with the default recipe (nvfp4-w4a16), input evicted from the page cache before each timed step:
#
#     bash benchmarks/families_pack.sh                  # this machine's CPUs (--device cpu)
#     bash benchmarks/families_pack.sh --device cuda    # the GPU machine
#
# PRESETS="bench-a bench-b" picks the presets. Extra arguments go to benchmarks/pack_throughput.py (--repeat 3, --workers 1 2, --quantize-alone, ...).
# The Markdown it prints is also written to $OUT (default benchmarks/results/families-pack-<N>cpus.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
WORK=${WORKDIR:-/tmp/kimi-convert-families}
OUT=${OUT:-benchmarks/results/families-pack-$(nproc)cpus.md}
for preset in ${PRESETS:-bench-qwen3-moe bench-glm4-moe bench-minimax-m2 bench-qwen3-5-moe bench-deepseek-v3 bench-gpt-oss}; do
    "$PY" benchmarks/pack_throughput.py --preset "$preset" --workdir "$WORK" --quantize-alone "$@"
    echo
done | tee "$OUT"
