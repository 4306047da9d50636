#!/bin/bash
# Issue 14 item 4 on the H200 machine: NVIDIA's Kimi K3 converter vs pack --recipe nvidia-k3 on
# synth bench-k3-shards, on the GPU (NVIDIA needs --jobs 1 there) and on the CPUs (NVIDIA --jobs 8, 16);
# `devices`: NVIDIA on the GPU against pack --device cuda, auto and cpu ($PACK_DEVICES). LAYERS=N: N layers, each MoE
# (2 by default: 4.8 GB; 4: 9.5 GB); the synth's load is let settle for 20 s. `warm`: the same as `devices` with the
# input read once before (page cache warm: the tools' own cost, not the disk's). `baseline`: the memory a process
# holds before it converts (benchmarks/cuda_baseline.py). `devices` and `warm` end with the disk floor (--floor).
# Needs, beside this tree: .whl/ (nvidia-modelopt 0.47.0 and what it imports that the machine lacks:
# pulp, pydantic, pydantic-core, annotated-types, typing-inspection, omegaconf, typing-extensions) and
# mo/ (Model Optimizer 575c27ae1's examples/_shard_cast_utils.py and examples/kimi/). Logs go to $OUT.
set -u
OUT=${OUT:-benchmarks/results/h200-speed}
W=${WORK:-/tmp/kc-speed}
mkdir -p "$OUT" "$W"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/install.log" 2>&1
{ nproc; free -g; df -h "$W"; nvidia-smi -L
  python3 -c "import torch, triton, modelopt; print('torch', torch.__version__, 'triton', triton.__version__, 'modelopt', modelopt.__version__)"
} > "$OUT/machine.log" 2>&1 || { cat "$OUT"/*.log; exit 1; }
case " $* " in *" baseline "*)
  python3 benchmarks/cuda_baseline.py --modelopt-repo mo --json "$OUT/baseline.json" 2>&1 | tee "$OUT/baseline.log" ;;
esac
case " $* " in *" devices "*|*" warm "*|*" cuda "*|*" cpu "*) ;; *) exit 0 ;; esac
{ time python3 -m kimi_convert.cli synth bench-k3-shards "$W/in" --overwrite --jobs 8 ${LAYERS:+--layers $LAYERS}; sleep 20; } > "$OUT/synth.log" 2>&1
for dev in "$@"; do
case $dev in
cuda) python3 benchmarks/compare_speed.py --modelopt-repo mo --input "$W/in" --device cuda --nvidia-jobs 1 \
        --work "$W" --json "$OUT/cuda.json" 2>&1 | tee "$OUT/cuda.log" ;;
devices) python3 benchmarks/compare_speed.py --modelopt-repo mo --input "$W/in" --device cuda --nvidia-jobs 1 \
        --pack-devices ${PACK_DEVICES:-cuda auto cpu} --pack-repeat ${REPEAT:-1} --floor --work "$W" \
        --json "$OUT/devices.json" 2>&1 | tee "$OUT/devices.log" ;;
warm) python3 benchmarks/compare_speed.py --modelopt-repo mo --input "$W/in" --device cuda --nvidia-jobs 1 --cold warm \
        --pack-devices ${PACK_DEVICES:-cuda auto cpu} --pack-repeat ${REPEAT:-1} --floor --work "$W" \
        --json "$OUT/warm.json" 2>&1 | tee "$OUT/warm.log" ;;
cpu) python3 benchmarks/compare_speed.py --modelopt-repo mo --input "$W/in" --device cpu --nvidia-jobs 8 16 \
        --work "$W" --json "$OUT/cpu.json" 2>&1 | tee "$OUT/cpu.log" ;;
esac
done
