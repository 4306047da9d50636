#!/bin/bash
# pack --device cpu on the H200 machine's 16 CPUs, input evicted before each run, with glibc's mmap threshold as
# pack sets it (1 MB: freed tensors go back to the system), left to glibc (KIMI_CONVERT_MMAP_THRESHOLD=0), and with
# torch's CPU allocator on huge pages (THP_MEM_ALLOC_ENABLE=1): wall, CPU, peak RSS, page faults. Runs on the
# input h200_speed.sh wrote ($WORK/in, synth bench-k3-shards); REPEAT runs each. Logs to $OUT.
# VARIANTS="name [VAR=value ...];..." replaces the three variants (the output arena: "arena;fresh-outputs
# KIMI_CONVERT_OUTPUT_ARENA=0"); PY: the Python that runs pack (python3).
set -u
OUT=${OUT:-benchmarks/results/h200-memory}
W=${WORK:-/tmp/kc-speed}
mkdir -p "$OUT"
# compare_speed.evict: written back, then each input file's pages dropped (any user)
PY=${PY:-python3}
evict() { "$PY" -c 'import sys; from pathlib import Path; sys.path.insert(0, "benchmarks"); from compare_speed import evict; evict(Path(sys.argv[1]))' "$1"; }
for r in $(seq ${REPEAT:-2}); do
IFS=';' read -ra variants <<< "${VARIANTS:-pack-sets-1MB;glibc-default KIMI_CONVERT_MMAP_THRESHOLD=0;thp THP_MEM_ALLOC_ENABLE=1}"
for v in "${variants[@]}"; do
  name=${v%% *}; envs=${v#"$name"}
  evict "$W/in"
  env $envs /usr/bin/time -f "$name run $r: wall %e s, user %U s, sys %S s, peak RSS %M KB, minor faults %R" \
      "$PY" -m kimi_convert.cli pack "$W/in" "$W/out-mem" -q --overwrite --recipe nvidia-k3 --device cpu \
      --stats "$OUT/$name-$r.json" 2>&1 | tail -1 | tee -a "$OUT/memory.log"
done
done
