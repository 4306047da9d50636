#!/bin/bash
# Issue 26 item 9 on the H200 machine: pack --device auto against cpu and cuda on synth bench-k3-shards
# (4.8 GB, NVIDIA's recipe), runs interleaved, input evicted before each (benchmarks/auto_vs_devices.py), then
# every configuration's last output compared byte for byte (--check-equal).
# CONFIGS: what runs (default "cpu cuda auto"). OLD_TREE: another tree of this repo (e.g. `git archive` of the
# commit before a change), run as the config "old-auto" (auto, its code first on PYTHONPATH). Logs to $OUT.
set -u
OUT=${OUT:-benchmarks/results/h200-auto}
W=${WORK:-/tmp/kc-auto}
mkdir -p "$OUT" "$W"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1
{ nproc; nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/machine.log" 2>&1
{ time python3 -m kimi_convert.cli synth bench-k3-shards "$W/in" --overwrite --jobs 8; } > "$OUT/synth.log" 2>&1
DEFINE=()
if [ -n "${OLD_TREE:-}" ]; then  # the old tree laid out as the installed package is (pyproject's package-dir)
  rm -rf "$W/shim" && mkdir -p "$W/shim" && cp -r "$OLD_TREE/convert" "$W/shim/kimi_convert"
  for d in kernels mappings recipes; do cp -r "$OLD_TREE/$d" "$W/shim/kimi_convert/$d"; done
  DEFINE=(--define "old-auto=auto,PYTHONPATH=$W/shim")
  PYTHONPATH="$W/shim" python3 -m kimi_convert.cli pack "$W/in" "$W/warm-old" --recipe nvidia-k3 --device auto -q > "$OUT/warmup-old.log" 2>&1
  rm -rf "$W/warm-old"
fi
python3 -m kimi_convert.cli pack "$W/in" "$W/warm" --recipe nvidia-k3 --device auto -q > "$OUT/warmup.log" 2>&1  # Triton's cache, torch from disk
rm -rf "$W/warm"
python3 benchmarks/auto_vs_devices.py --input "$W/in" --work "$W" --rounds ${ROUNDS:-3} --configs ${CONFIGS:-cpu cuda auto} \
  "${DEFINE[@]}" --check-equal --json "$OUT/auto.json" 2>&1 | tee "$OUT/auto.log"
