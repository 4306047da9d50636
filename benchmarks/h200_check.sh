#!/bin/bash
# Issue 42 on the H200 machine: the GPU machine's check of what landed, in one or two calls.
#   OUT=... bash benchmarks/h200_check.sh STAGE...      (carry .whl .peer-wheels mo)
# Stages, in the order given:
#   tests     pytest -m gpu (tests/test_gpu.py, tests/test_gpu_kernels.py; -n $TEST_WORKERS): Triton == the C
#             kernels == the torch code; --device cuda and auto packs == --device cpu packs, every preset x
#             recipe x format x layout
#   k3-auto   --device auto against cpu and cuda on synth bench-k3-shards (4.83 GB, NVIDIA's recipe), input
#             evicted, interleaved, $ROUNDS rounds (benchmarks/auto_vs_devices.py), then the same bytes
#   k3-gpu    NVIDIA's K3 converter on the GPU against pack --device cuda, auto, cpu, then the disk floor
#             (benchmarks/compare_speed.py --floor); every tensor compared with NVIDIA's
#   k3-cpu    NVIDIA's converter on the CPUs (--jobs $NVIDIA_CPU_JOBS) against pack --device cpu
#   ct-auto   --device auto against cpu and cuda on a 10 GB one-file Qwen3 MoE (synth bench-qwen3-moe --layers 8
#             --shards 1), --recipe ct-nvfp4-a16, as k3-auto
#   k25-auto  as k3-auto on synth bench-kimi-k25 (2.1 GB: INT4 pack-quantized experts, the default recipe; K25_LAYERS
#             sets its layer count: 8 is 1 dense + 7 MoE layers, about 5.5 GB)
#   dsv4-auto as k3-auto on synth bench-deepseek-v4 (1.9 GB, MXFP4 experts), recipe nvidia-dsv4 (the MXFP4 -> NVFP4
#             cast)
#   ct-gpu    the same input: pack --device auto and cpu against llm-compressor's model_free_ptq on device="cuda"
#             (max_workers 1; benchmarks/ct_speed.py)
#   kl-gpu    the same on synth bench-kimi-linear (2.4 GB, 4 files), the peer with max_workers 1 and 2
#   families  issue 38's bench-* presets of the 2026 families ($FAMILIES) packed against the disk floor with
#             --device cpu, input evicted, medians of $FAMILY_REPEAT (benchmarks/pack_throughput.py --quantize-alone),
#             on every CPU and on two (taskset -c 0,1: $FAMILY_CPUS), one Markdown report each; an entry PRESET@N
#             packs N layers, PRESET@eN N routed experts a MoE layer (a larger input, as benchmarks/families_pack.sh)
# Every stage's logs go to /tmp/kc-check/logs, copied to $OUT/logs.tgz after each stage (the device tool returns
# at most 8 files); the last lines of each stage are printed. DEADLINE (s, default 560): a stage starts only if
# its estimate fits before it, and is stopped there. Inputs are kept in $WORK between calls on a warm machine.
# Dry run without a GPU (the script's own code, tiny inputs): DRY=1 PY=.venv/bin/python bash benchmarks/h200_check.sh
# k3-auto ct-auto (DRY: pack's --device cuda replaced by the torch code on the CPU, NVIDIA's converter on the CPU, no wheels, no
# peer, tiny presets).
set -u
OUT=${OUT:-benchmarks/results/h200-check}
W=${WORK:-/tmp/kc-check}
L=$W/logs
PY=${PY:-python3}
DEADLINE=${DEADLINE:-560}
ROUNDS=${ROUNDS:-3}
GPU=cuda; K3=(bench-k3-shards --jobs 8); CT=(bench-qwen3-moe --layers 8 --shards 1); KL=(bench-kimi-linear)
K25=(bench-kimi-k25 --jobs 8 ${K25_LAYERS:+--layers $K25_LAYERS}); DSV4=(bench-deepseek-v4 --jobs 8)
if [ -n "${DRY:-}" ]; then GPU=reference; K3=(tiny-k3); CT=(tiny-qwen3-moe --shards 1); KL=(tiny-kimi-linear)
  K25=(tiny-kimi-k25); DSV4=(tiny-deepseek-v4); fi
mkdir -p "$OUT" "$L"
export PYTHONUNBUFFERED=1 KIMI_CONVERT_LLMC_PYTHON=$PY TQDM_DISABLE=1
unset TRITON_INTERPRET

save() { tar czf "$OUT/logs.tgz" -C "$L" . 2>/dev/null; }
say() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$L/run.log"; }

setup() {  # the wheels this python lacks (NVIDIA's converter's first: h200_speed.sh's list), this tree, the C kernels
  if [ -z "${DRY:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      > "$L/install.log" 2>&1
    export PYTHONPATH=/tmp/site
    $PY - >> "$L/install.log" 2>&1 <<'EOF'
import importlib.metadata as md, pathlib, subprocess, sys
missing = []
for w in sorted(pathlib.Path(".peer-wheels").glob("*.whl")):
    try:
        md.version(w.name.split("-")[0])
    except md.PackageNotFoundError:
        missing.append(str(w))
print("peer wheels installed:", [pathlib.Path(m).name for m in missing])
if missing:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--target", "/tmp/site", *missing], check=True)
EOF
    $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$L/install.log" 2>&1
  fi
  { git log -1 --format="%h %s" 2>/dev/null || echo "tree: no git"; nproc
    lscpu | grep -iE "model name|thread|core|socket|numa"; free -g; df -h /tmp; nvidia-smi -L
    $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    $PY -c "import modelopt, llmcompressor, compressed_tensors as ct, transformers; print('modelopt', \
modelopt.__version__, 'llmcompressor', llmcompressor.__version__, 'compressed-tensors', ct.__version__, \
'transformers', transformers.__version__)"
    $PY -c "import hashlib, os, time; b = os.urandom(1 << 28); t = time.perf_counter(); hashlib.sha256(b).digest(); \
print('sha256 GB/s', round(0.268 / (time.perf_counter() - t), 2))"
  } > "$L/machine.log" 2>&1
  $PY -c "from kimi_convert.kernels import clib; assert clib.load() is not None" >> "$L/install.log" 2>&1 \
    || { cat "$L/install.log"; exit 1; }
  cat "$L/machine.log"
}

synth() {  # synth NAME ARGS...: $W/NAME, unless a previous call on this machine wrote it
  local dir=$W/$1; shift
  [ -f "$dir/config.json" ] || { /usr/bin/time -f "synth $*: %e s" $PY -m kimi_convert.cli synth "$1" "$dir" \
    --overwrite "${@:2}" > /dev/null; } 2>> "$L/synth.log"
}

warm_up() {  # untimed: torch, Triton's cache and the C kernels from the disk once ($1: a tiny preset, $2: recipe)
  synth "warm-$1" "$1"
  for d in $GPU auto; do $PY -m kimi_convert.cli pack "$W/warm-$1" "$W/warm-out" -q --overwrite --device $d \
    ${2:+--recipe $2} >> "$L/warm-up.log" 2>&1; done
}

stage() {
  case $1 in
  tests) TRITON_INTERPRET= timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -m gpu tests/test_gpu.py tests/test_gpu_kernels.py -p no:cacheprovider \
      -p no:benchmark -vv --dist loadgroup --basetemp "$W/pt" -n "${TEST_WORKERS:-4}" -rfEs --durations=25 \
      ${TEST_K:+-k "$TEST_K"} > "$L/tests.log" 2>&1
    local rc=$?; rm -rf "$W/pt"; grep -E "FAILED|ERROR" "$L/tests.log" | head -20; tail -30 "$L/tests.log"; return $rc ;;
  k3-auto|ct-auto|k25-auto|dsv4-auto)
    local name=k3 recipe=nvidia-k3 tiny=tiny-k3 in=("${K3[@]}")
    [ "$1" = ct-auto ] && { name=ct; recipe=ct-nvfp4-a16; tiny=tiny-qwen3-moe; in=("${CT[@]}"); }
    [ "$1" = k25-auto ] && { name=k25; recipe=nvfp4-w4a16; tiny=tiny-kimi-k25; in=("${K25[@]}"); }
    [ "$1" = dsv4-auto ] && { name=dsv4; recipe=nvidia-dsv4; tiny=tiny-deepseek-v4; in=("${DSV4[@]}"); }
    synth "$name" "${in[@]}"; warm_up $tiny $recipe
    $PY benchmarks/auto_vs_devices.py --input "$W/$name" --work "$W/auto-$name" --recipe $recipe --rounds "$ROUNDS" \
      --configs cpu $GPU auto --check-equal --json "$L/$name-auto.json" > "$L/$name-auto.log" 2>&1
    local rc=$?; tail -8 "$L/$name-auto.log"; rm -rf "$W/auto-$name"; return $rc ;;
  k3-gpu|k3-cpu)
    synth k3 "${K3[@]}"
    local dev=${DRY:+cpu} jobs=1 more=(--pack-devices $GPU auto cpu --floor)
    dev=${dev:-cuda}
    [ "$1" = k3-cpu ] && { dev=cpu; jobs=${NVIDIA_CPU_JOBS:-16}; more=(); [ -n "${K3_GPU_DONE:-}" ] && more=(--no-warmup); }
    $PY benchmarks/compare_speed.py --modelopt-repo mo --input "$W/k3" --device $dev --nvidia-jobs $jobs "${more[@]}" \
      --work "$W/speed" --json "$L/$1.json" > "$L/$1.log" 2>&1
    local rc=$?; tail -14 "$L/$1.log"; return $rc ;;
  ct-gpu|kl-gpu)
    local src=(--input "$W/ct") workers=(1)
    if [ "$1" = kl-gpu ]; then synth kl "${KL[@]}"; src=(--input "$W/kl"); workers=(1 2)
    else synth ct "${CT[@]}"; fi
    [ -n "${DRY:-}" ] && workers=()
    $PY benchmarks/ct_speed.py "${src[@]}" --device auto cpu --peer-device cuda --peer-workers "${workers[@]}" \
      --stats-dir "$L/$1-stats" --work "$W/$1" --json "$L/$1.json" > "$L/$1.log" 2>&1
    local rc=$?; tail -6 "$L/$1.log"; rm -rf "$W/$1"; return $rc ;;
  families)
    local rc=0 f c
    for f in ${FAMILIES:-bench-minimax-m3 bench-kimi-k25 bench-glm5-next bench-deepseek-v4}; do
      [ -n "${DRY:-}" ] && f=${f/bench-/tiny-}
      local size=()  # PRESET@N: N layers, PRESET@eN: N routed experts (as benchmarks/families_pack.sh)
      case $f in *@e*) size=(--experts "${f#*@e}") ;; *@*) size=(--layers "${f#*@}") ;; esac
      synth "fam-$f" "${f%@*}" --jobs 8 "${size[@]}"
      for c in ${FAMILY_CPUS:-all 2}; do
        local pin=()
        [ "$c" = all ] || pin=(taskset -c "0-$((c - 1))")
        "${pin[@]}" $PY benchmarks/pack_throughput.py --input "$W/fam-$f" --workdir "$W/fam-work" --quantize-alone \
          --repeat "${FAMILY_REPEAT:-3}" > "$L/families-$f-cpus$c.md" 2>&1 || rc=1
        grep -E "^disk floor:|^CPU floor|^\| [0-9]|^disk floor, median" "$L/families-$f-cpus$c.md" | head -8 | sed "s|^|$f cpus $c: |"
      done
      rm -rf "$W/fam-$f" "$W/fam-work"; save  # each preset's report back even if the call is cut
    done
    return $rc ;;
  *) echo "unknown stage $1"; return 2 ;;
  esac
}

#: each stage's seconds on the GPU machine, from sessions 19, 21, 22 and 23 (a stage starts only if it fits; session
#: 23 on an H100 host: k3-cpu 162 s with its input's synth and the tiny warm-up, k3-gpu 153 s after it, families 200 s
#: for 3 presets x 2 CPU counts, one pack each): tests is a TEST_K selection (the whole matrix, 336 tests, -n 8,
#: needs about 650 s: two calls, the second with TEST_K naming what the first did not finish)
estimate() { case $1 in tests) echo 300 ;; k3-auto) echo 145 ;; k3-gpu) echo 180 ;; k3-cpu) echo 200 ;;
  ct-auto) echo 180 ;; ct-gpu) echo 120 ;; kl-gpu) echo 90 ;; k25-auto) echo 150 ;; dsv4-auto) echo 130 ;;
  families) echo 240 ;;
  *) echo 0 ;; esac; }

if [ "${1:-}" = __stage ]; then stage "$2"; exit $?; fi
say "setup"; setup; save
# the first input a stage after the tests needs, written beside them (the tests are not timed)
case " $* " in *" tests "*)
  # a previous call's inputs on a warm machine plus the bench groups' packs filled the 64 GB disk (session 22)
  find "$W" -mindepth 1 -maxdepth 1 ! -name logs -exec rm -rf {} +
  case " $* " in *" k3-"*) synth k3 "${K3[@]}" & ;; *" ct-"*) synth ct "${CT[@]}" & ;; esac ;;
esac
status=0
for s in "$@"; do
  [ "$s" = tests ] || wait
  left=$((DEADLINE - SECONDS))
  if [ "$left" -lt "$(estimate "$s")" ]; then say "$s: NOT RUN (${left} s left, estimate $(estimate "$s") s)"; continue; fi
  say "$s: start"
  timeout "$left" bash "$0" __stage "$s"
  rc=$?
  [ "$s" = k3-gpu ] && [ $rc = 0 ] && export K3_GPU_DONE=1
  say "$s: rc $rc"; [ $rc = 0 ] || status=1
  save
done
df -h /tmp | tail -1 | tee -a "$L/run.log"; save
exit $status
