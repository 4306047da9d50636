#!/bin/bash
# pack --device cpu on the H200 machine's 16 CPUs, input evicted before each run: wall, CPU, peak RSS, page faults,
# for pack as it is and with one of its memory measures undone in the process (no switch in the tool for it: the
# variant's Python runs before the CLI, in the same process, which is what /usr/bin/time measures):
#   pack            as shipped;
#   glibc-default   glibc's mmap threshold left to glibc (pack fixes it at 1 MB: pipeline.budgets.return_freed_memory);
#   fresh-outputs   the C kernels allocate fresh outputs instead of writing into a lent pool buffer (runner's arena;
#                   --device cpu only: with no chooser, work_kind only decides whether a unit gets the arena);
#   thp             torch's CPU allocator on huge pages (THP_MEM_ALLOC_ENABLE=1, torch's own setting).
# Runs on the input h200_speed.sh wrote ($WORK/in, synth bench-k3-shards); REPEAT runs each; VARIANTS picks them
# (default "pack glibc-default fresh-outputs thp"); PY: the Python that runs pack (python3). Logs to $OUT.
set -u
OUT=${OUT:-benchmarks/results/h200-memory}
W=${WORK:-/tmp/kc-speed}
mkdir -p "$OUT"
PY=${PY:-python3}
# compare_speed.evict: written back, then each input file's pages dropped (any user)
evict() { "$PY" -c 'import sys; from pathlib import Path; sys.path.insert(0, "benchmarks"); from compare_speed import evict; evict(Path(sys.argv[1]))' "$1"; }
patch_for() {
  case $1 in
    glibc-default) echo 'from kimi_convert.pipeline import stream; assert stream.return_freed_memory; stream.return_freed_memory = lambda threshold: False' ;;
    fresh-outputs) echo 'from kimi_convert.pipeline import runner; assert runner.work_kind; runner.work_kind = lambda unit: None' ;;
    *) echo 'pass' ;;
  esac
}
for r in $(seq "${REPEAT:-2}"); do
for name in ${VARIANTS:-pack glibc-default fresh-outputs thp}; do
  envs=(); [ "$name" = thp ] && envs=(THP_MEM_ALLOC_ENABLE=1)
  evict "$W/in"
  env "${envs[@]}" /usr/bin/time -f "$name run $r: wall %e s, user %U s, sys %S s, peak RSS %M KB, minor faults %R" \
      "$PY" -c "import sys; $(patch_for "$name")
from kimi_convert.cli import main; sys.argv[0] = 'kimi-convert'; main()" \
      pack "$W/in" "$W/out-mem" -q --overwrite --recipe nvidia-k3 --device cpu --stats "$OUT/$name-$r.json" 2>&1 \
      | tail -1 | tee -a "$OUT/memory.log"
done
done
