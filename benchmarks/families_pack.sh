#!/usr/bin/env bash
# pack of the Qwen3 MoE, GLM-4.5, MiniMax-M2, Qwen3.5 MoE, DeepSeek V3 (FP8 source) and gpt-oss (MXFP4 banks, cast) bench presets at real width (docs/families.md), against the disk floor,
# with the default recipe (nvfp4-w4a16), input evicted from the page cache before each timed step:
#
#     bash benchmarks/families_pack.sh                  # this machine's CPUs (--device cpu)
#     bash benchmarks/families_pack.sh --device cuda    # the GPU machine
#
# PRESETS="bench-a bench-b" picks the presets (PRESETS=2026: issue 38's nine 2026 releases); an entry PRESET@N packs the
# preset with N layers, PRESET@eN with N routed experts a MoE layer (synth --layers / --experts: a larger input, where
# the process's start and a small file's reads weigh less). Extra arguments go to
# benchmarks/pack_throughput.py (--repeat 3, --workers 1 2, --quantize-alone, ...). Each preset's input and outputs are
# removed before the next (KEEP_INPUTS=1 keeps them): nine presets at real width would need about 30 GB at once.
# The Markdown it prints is also written to $OUT (default benchmarks/results/families-pack-<N>cpus.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
WORK=${WORKDIR:-/tmp/kimi-convert-families}
OUT=${OUT:-benchmarks/results/families-pack-$(nproc)cpus.md}
PRESETS=${PRESETS:-bench-qwen3-moe bench-glm4-moe bench-minimax-m2 bench-qwen3-5-moe bench-deepseek-v3 bench-gpt-oss}
if [ "$PRESETS" = 2026 ]; then
    PRESETS="bench-glm5 bench-glm4-moe-lite bench-glm5-next bench-deepseek-v3-2 bench-deepseek-v4 bench-minimax-m3
             bench-kimi-k25 bench-qwen4-exp bench-mistral-large-3"
fi
for entry in $PRESETS; do
    preset=${entry%@*}
    size=()
    case $entry in *@e*) size=(--experts "${entry#*@e}") ;; *@*) size=(--layers "${entry#*@}") ;; esac
    "$PY" benchmarks/pack_throughput.py --preset "$preset" "${size[@]}" --workdir "$WORK" --quantize-alone "$@"
    [ -n "${KEEP_INPUTS:-}" ] || rm -rf "$WORK"
    echo
done | tee "$OUT"
