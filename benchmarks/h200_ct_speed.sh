#!/bin/bash
# Issue 24 item 4 on the GPU machine: `pack --recipe ct-nvfp4-a16` against llm-compressor's model_free_ptq
# (device="cuda") on one 10 GB input file (`synth bench-qwen3-moe --layers 8 --shards 1`: the only layout of
# this input the peer runs on), in one call: where ours spends its time (benchmarks/ct_profile.py: the machine's
# sha256 and cold-read rates, pack variants with their --stats), ours with --device auto and cpu against the
# peer with max_workers 1 (benchmarks/ct_speed.py); then the same bytes on every device (a 2.5 GB input:
# cuda, auto, cpu, `diff -r` against the CPU's; then bench-deepseek-v3 and bench-k3 the same way, timed).
# Needs, beside this tree: .peer-wheels/ (llm-compressor 0.14.0.1 and what it imports that the machine may
# lack, downloaded for Python 3.12 with `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 ...`: the wheels the machine already has are skipped). Logs go to $OUT.
set -u
OUT=${OUT:-benchmarks/results/h200-ct}
W=${WORK:-/tmp/kc-ct}
mkdir -p "$OUT" "$W"
python3 - > "$OUT/install.log" 2>&1 <<'EOF'
# the wheels whose distribution this python lacks (the machine's own torch, transformers, ... are kept)
import importlib.metadata as md, pathlib, subprocess, sys
missing = []
for w in sorted(pathlib.Path(".peer-wheels").glob("*.whl")):
    name = w.name.split("-")[0]
    try:
        print("present", name, md.version(name))
    except md.PackageNotFoundError:
        missing.append(str(w))
print("installing", [pathlib.Path(m).name for m in missing])
if missing:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--target", "/tmp/site", *missing], check=True)
EOF
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 KIMI_CONVERT_LLMC_PYTHON=python3
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/install.log" 2>&1
{ nproc; lscpu | grep -iE "model name|thread|core|socket|mhz|numa"
  for c in 0 1; do echo "cpu$c thread siblings: $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list)"; done
  free -g; df -h "$W"; nvidia-smi -L
  python3 -c "import torch, transformers, llmcompressor, compressed_tensors as ct; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'llmcompressor', llmcompressor.__version__, 'compressed-tensors', ct.__version__)"
  for i in 1 2; do /usr/bin/time -f "import torch: %e s" python3 -c "import torch"; done
} > "$OUT/machine.log" 2>&1 || { cat "$OUT"/*.log; exit 1; }
# the C kernels built once for this machine (a first use compiles them: 2-3 s, once per machine and version)
python3 -c "from kimi_convert.kernels import clib; assert clib.load() is not None" >> "$OUT/install.log" 2>&1
# KIMI_LINEAR=1: instead, the speed table on the 2-core figure's input (`synth bench-kimi-linear`, 2.4 GB, 4 files),
# ours auto and cpu against the peer on cuda with max_workers 1 and 2, then stop
if [ -n "${KIMI_LINEAR:-}" ]; then
  python3 benchmarks/ct_speed.py --preset bench-kimi-linear --device auto cpu --peer-workers 1 2 --peer-device cuda \
    --work "$W/kl" --json "$OUT/ct-speed-kimi-linear.json" 2>&1 | tee "$OUT/ct-speed-kimi-linear.log"
  exit 0
fi
{ time python3 -m kimi_convert.cli synth bench-qwen3-moe "$W/q8" --layers 8 --shards 1 --overwrite; } > "$OUT/synth.log" 2>&1
# DISK_RATES=1: the disk's cold read rates first, 1-8 concurrent reads of each 64 MB, alone and beside a writer
[ -n "${DISK_RATES:-}" ] && python3 benchmarks/disk_rates.py --input "$W/q8" --threads 1 2 4 8 --json "$OUT/disk-rates.json" \
  2>&1 | tee "$OUT/disk-rates.log"
# the defaults; the C kernels on 12 and 8 of the 16 CPUs (the rest left to the hashes and the reader); 6 hashing
# threads
# (PROFILE="variant;variant;...": those instead; PROFILE_ONLY=1: stop after the profile)
VARIANTS=("auto" "cpu" "cpu kthreads=12" "cpu kthreads=8" "cpu hash=6")
[ -n "${PROFILE:-}" ] && IFS=';' read -r -a VARIANTS <<< "$PROFILE"
python3 benchmarks/ct_profile.py --input "$W/q8" --json "$OUT/ct-profile.json" --variant "${VARIANTS[@]}" 2>&1 | tee "$OUT/ct-profile.log"
# THREAD_CPU=1: each thread's CPU seconds in one cpu pack (benchmarks/thread_cpu.py: what loads the CPUs beside the
# input file's one sha256 chain)
[ -n "${THREAD_CPU:-}" ] && python3 benchmarks/thread_cpu.py --input "$W/q8" --json "$OUT/thread-cpu.json" 2>&1 \
  | tee "$OUT/thread-cpu.log"
[ -n "${PROFILE_ONLY:-}" ] && exit 0
python3 benchmarks/ct_speed.py --input "$W/q8" --device auto cpu --peer-workers 1 \
  --peer-device cuda --work "$W/run" --json "$OUT/ct-speed.json" 2>&1 | tee "$OUT/ct-speed.log"
# SPEED_ONLY=1: stop after the speed table (the same-bytes checks below take ~150 s of device time)
[ -n "${SPEED_ONLY:-}" ] && exit 0
python3 -m kimi_convert.cli synth bench-qwen3-moe "$W/q2" --layers 2 --shards 1 --overwrite > /dev/null
python3 -m kimi_convert.cli pack "$W/q2" "$W/ref" -q --recipe ct-nvfp4-a16 --device cpu --streams 1
for dev in cuda auto cpu; do
  python3 -m kimi_convert.cli pack "$W/q2" "$W/o" -q --overwrite --recipe ct-nvfp4-a16 --device $dev
  if diff -r "$W/ref" "$W/o" > /dev/null; then echo "$dev: every file identical"; else echo "$dev: DIFFERENT"; fi
done 2>&1 | tee "$OUT/same-bytes.log"
# the other sources the C kernels take without torch (DeepSeek's FP8 blocks; K3's MXFP4 and BF16, under NVIDIA's
# recipe) on the GPU and with auto (the probe: which kinds the GPU won, in each --stats): each the CPU's files
for preset in bench-deepseek-v3 bench-k3; do
  python3 -m kimi_convert.cli synth $preset "$W/$preset" --overwrite > /dev/null
  for dev in cpu cuda auto; do
    rm -rf "$W/o-$dev"
    /usr/bin/time -f "$preset $dev: %e s, %M KB" python3 -m kimi_convert.cli pack "$W/$preset" "$W/o-$dev" -q \
      --device $dev --stats "$OUT/$preset-$dev.json"
  done
  for dev in cuda auto; do
    if diff -r "$W/o-cpu" "$W/o-$dev" > /dev/null; then echo "$preset $dev: every file identical"
    else echo "$preset $dev: DIFFERENT"; fi
  done
  rm -rf "$W/$preset" "$W"/o-*
done 2>&1 | tee -a "$OUT/same-bytes.log"
