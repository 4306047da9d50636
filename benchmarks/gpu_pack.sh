#!/bin/bash
# Issue 6 on a GPU machine: pack against the disk floor (cuda and cpu), warm-cache worker scaling,
# peak RSS as the checkpoint grows (cuda/cpu/workers byte equality: tests/test_gpu.py). Logs go to $OUT (or
# benchmarks/results/gpu-pack). Usage: bash benchmarks/gpu_pack.sh [throughput|cpu|warm|rss]...
set -u
OUT=${OUT:-benchmarks/results/gpu-pack}
W=${WORK:-/tmp/kc}
L=${LAYERS:-4}
mkdir -p "$OUT" "$W"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1
{ nproc; free -g; df -h "$W"; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
  python3 -c "import hashlib, os, time; b = os.urandom(1 << 28); t = time.perf_counter(); hashlib.sha256(b).digest(); print('sha256 GB/s', round(0.268 / (time.perf_counter() - t), 2))"
} > "$OUT/machine.log" 2>&1
T=benchmarks/pack_throughput.py
for what in "$@"; do
case $what in
throughput) n=$(python3 -c "import torch; print(torch.cuda.device_count())")
    python3 $T --device cuda --layers "$L" --cold input --quantize-alone --workers 1 "$n" --repeat 2 --workdir "$W" \
        2>&1 | tee "$OUT/throughput-cuda.log" ;;
cpu) python3 $T --device cpu --layers "$L" --cold input --quantize-alone --workers 1 --repeat 2 --workdir "$W" \
        2>&1 | tee "$OUT/throughput-cpu.log" ;;
warm) n=$(python3 -c "import torch; print(torch.cuda.device_count())")
    python3 $T --device cuda --layers "$L" --cold warm --workers 1 "$n" --repeat 3 --workdir "$W" 2>&1 \
        | tee "$OUT/throughput-cuda-warm.log" ;;
rss) python3 benchmarks/pack_rss.py --device cuda --layers 2 4 8 --workdir "$W" 2>&1 | tee "$OUT/rss-cuda.log" ;;
esac
done
