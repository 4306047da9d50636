#!/bin/bash
# Issue 26 item 9 on the H200 machine: pack --device auto against cpu and cuda on synth bench-k3-shards
# (4.8 GB, NVIDIA's recipe), runs interleaved, input evicted before each (benchmarks/auto_vs_devices.py).
# CONFIGS: what runs (default "cpu cuda auto auto:1"; auto:1 = the plain comparison before issue 26). Logs to $OUT.
set -u
OUT=${OUT:-benchmarks/results/h200-auto}
W=${WORK:-/tmp/kc-auto}
mkdir -p "$OUT" "$W"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1
{ nproc; nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/machine.log" 2>&1
{ time python3 -m kimi_convert.cli synth bench-k3-shards "$W/in" --overwrite --jobs 8; } > "$OUT/synth.log" 2>&1
python3 -m kimi_convert.cli pack "$W/in" "$W/warm" --recipe nvidia-k3 --device auto -q > "$OUT/warmup.log" 2>&1  # Triton's cache, torch from disk
python3 benchmarks/auto_vs_devices.py --input "$W/in" --work "$W" --rounds ${ROUNDS:-3} --configs ${CONFIGS:-cpu cuda auto auto:1} \
  --json "$OUT/auto.json" 2>&1 | tee "$OUT/auto.log"
