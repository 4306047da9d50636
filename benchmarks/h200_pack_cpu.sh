#!/bin/bash
# One short device call: synth bench-k3-shards (4.83 GB, 24 shards), then pack --recipe nvidia-k3 with each
# --device in $DEVICES (default: cpu auto), input evicted before each: wall, CPU, peak RSS (/usr/bin/time) and
# --stats. Compare with NVIDIA's converter's runs of benchmarks/h200_speed.sh on the same input. Logs to $OUT.
set -u
OUT=${OUT:-benchmarks/results/h200-pack-cpu}
W=${WORK:-/tmp/kc-speed}
mkdir -p "$OUT" "$W"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1
python3 -m kimi_convert.cli synth bench-k3-shards "$W/in" --overwrite --jobs 8 > "$OUT/synth.log" 2>&1
sleep 10
for d in ${DEVICES:-cpu auto}; do
  python3 -c 'import sys; from pathlib import Path; sys.path.insert(0, "benchmarks"); from compare_speed import evict; evict(Path(sys.argv[1]))' "$W/in"  # compare_speed.evict
  /usr/bin/time -f "pack --device $d: wall %e s, user %U s, sys %S s, peak RSS %M KB" python3 -m kimi_convert.cli pack \
      "$W/in" "$W/out" -q --overwrite --recipe nvidia-k3 --device "$d" --stats "$OUT/stats-$d.json" 2>&1 | tail -1 \
      | tee -a "$OUT/pack.log"
  python3 -c "import json; s = json.load(open('$OUT/stats-$d.json')); print('  stages', {k: round(v, 1) for k, v in s['stages_s'].items()}, 'chose', s.get('device_choices'))" | tee -a "$OUT/pack.log"
done
