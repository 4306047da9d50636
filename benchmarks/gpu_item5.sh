#!/bin/bash
# Issue 14 item 5 on a GPU machine, one call: a synthetic K3 at real width (bench-k3, LAYERS layers, 16 shards,
# written in parallel), and pack against the disk floor: this checkout's --device cuda, then, when BEFORE names
# another checkout, that code's --device cuda (installed over this one, then this one put back), then this
# checkout's --device auto and cpu. (cpu == cuda == auto, byte for byte: tests/test_gpu.py.) Run from this
# checkout's root; logs go to $OUT.
#   bash benchmarks/gpu_item5.sh            (LAYERS=12 REPEAT=1 BEFORE=/path/to/main/checkout)
set -u
OUT=${OUT:-benchmarks/results/gpu-item5}
W=${WORK:-/tmp/kc}
L=${LAYERS:-12}
R=${REPEAT:-1}
HERE=$PWD
mkdir -p "$OUT" "$W"
install() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .) >> "$OUT/install.log" 2>&1; }
install "$HERE"
{ nproc; free -g; df -h "$W"; nvidia-smi -L; echo "code: ${LABEL:-now}"
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/machine.log" 2>&1
K3="$W/bench-k3-L$L"
[ -f "$K3/config.json" ] || kimi-convert synth bench-k3 "$K3" --layers "$L" --shards 16 --jobs "$(nproc)" \
    2>&1 | tee "$OUT/synth.log"
P="python3 benchmarks/gpu_pack_devices.py $K3 --repeat $R --workdir $W"
$P --floor --label "${LABEL:-now}" --device cuda 2>&1 | grep -v warning | tee "$OUT/pack.log"
if [ -n "${BEFORE:-}" ]; then  # the other checkout's --device cuda, right after (the same disk, the same hour)
    install "$BEFORE"
    $P --label before --device cuda 2>&1 | grep -v warning | tee "$OUT/pack-before.log"
    install "$HERE"
fi
$P --label "${LABEL:-now}" --device auto cpu 2>&1 | grep -v warning | tee -a "$OUT/pack.log"
