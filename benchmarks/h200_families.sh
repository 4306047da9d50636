#!/bin/bash
# New families on the H200 machine, one short call: the GPU writes the CPU's bytes for each preset named.
#   OUT=benchmarks/results/h200-families bash benchmarks/h200_families.sh tiny-NEW bench-NEW ...
# (no wheels to carry). For the presets named:
#   1. pytest -m gpu on tests/test_gpu.py, selected by the preset names (-k "P1 or P2 ..."): a tiny preset under
#      every recipe x format x layout (--device cuda == --device cpu, or the same refusal), and --device auto taking
#      the GPU for every kind of work; a bench preset at real width (fewer experts) under its default recipe and
#      ct-nvfp4-a16. A preset name that is not a synth preset selects nothing: the log says "deselected".
#   2. each preset written whole (synth, as the preset is) and packed with --device cpu, cuda and auto under each
#      of $RECIPES ("default": the mapping's; default "default ct-nvfp4-a16"), each timed (wall, peak RSS) with its
#      --stats, every file of the cuda and auto outputs compared with the cpu output's: "same" or "DIFF".
# Logs in /tmp/kc-families/logs, copied to $OUT/logs.tgz after the tests and after each preset (what a `timeout`
# around the script leaves comes back); the summary is printed last. Exit 1 on a DIFF or a failed test. Session 19's
# times there suggest 150-300 s of command for a tiny and a bench preset of 1-3 GB, plus the machine's start (75 s).
# Dry run without a GPU: DRY=1 PY=.venv/bin/python bash benchmarks/h200_families.sh tiny-qwen3-moe (cuda replaced
# by the torch code on the CPU; the GPU tests skipped).
set -u
OUT=${OUT:-benchmarks/results/h200-families}
W=${WORK:-/tmp/kc-families}
L=$W/logs
PY=${PY:-python3}
GPU=cuda; [ -n "${DRY:-}" ] && GPU=reference
mkdir -p "$OUT" "$L"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
unset TRITON_INTERPRET
[ $# -gt 0 ] || { echo "usage: bash benchmarks/h200_families.sh PRESET..."; exit 2; }
[ -n "${DRY:-}" ] || $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$L/install.log" 2>&1
{ git log -1 --format="%h %s" 2>/dev/null; nproc; nvidia-smi -L
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$L/machine.log" 2>&1
status=0
k=$(printf ' or %s' "$@"); k=${k# or }
TRITON_INTERPRET= $PY -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -n "${TEST_WORKERS:-4}" -rs -k "$k" \
  > "$L/tests.log" 2>&1 || status=1
tail -5 "$L/tests.log" | tee "$L/summary.log"
save() { tar czf "$OUT/logs.tgz" -C "$L" .; }
save
for preset in "$@"; do
  $PY -m kimi_convert.cli synth "$preset" "$W/$preset" --overwrite --jobs 8 > /dev/null 2>> "$L/synth.log" \
    || { echo "$preset: synth failed" | tee -a "$L/summary.log"; status=1; continue; }
  for recipe in ${RECIPES:-default ct-nvfp4-a16}; do
    r=(); [ "$recipe" = default ] || r=(--recipe "$recipe")
    for dev in cpu $GPU auto; do
      rm -rf "$W/o-$dev"
      /usr/bin/time -f "$preset $recipe $dev: %e s, peak RSS %M KB" $PY -m kimi_convert.cli pack "$W/$preset" \
        "$W/o-$dev" -q --device $dev "${r[@]}" --stats "$L/$preset-$recipe-$dev.json" 2>> "$L/packs.log" \
        || { echo "$preset $recipe $dev: pack failed (packs.log)" | tee -a "$L/summary.log"; status=1; }
      tail -1 "$L/packs.log" >> "$L/summary.log"
    done
    for dev in $GPU auto; do
      for f in $(cd "$W/o-cpu" 2>/dev/null && find . -type f | sort); do
        if cmp -s "$W/o-cpu/$f" "$W/o-$dev/$f"; then echo "same $preset $recipe $dev $f"
        else echo "DIFF $preset $recipe $dev $f"; status=1; fi
      done >> "$L/same-bytes.log"
      n=$(grep -c "^same $preset $recipe $dev " "$L/same-bytes.log"); d=$(grep -c "^DIFF $preset $recipe $dev " "$L/same-bytes.log")
      echo "$preset $recipe: $dev against cpu: $n files the same, $d different" | tee -a "$L/summary.log"
    done
    rm -rf "$W"/o-*
  done
  rm -rf "${W:?}/$preset"
  save
done
echo "--- summary"; cat "$L/summary.log"
exit $status
