#!/bin/bash
# A/B of two checkouts' packs (issue 38): NEW against OLD (each a folder whose kimi_convert links a checkout's
# convert/), every preset of $PRESETS, N runs each in turn, the input evicted before each (benchmarks/ab_pack.py); each
# JSON to $OUT/ab-PRESET.json; shards and records files compared with cmp.
# Run: NEW=... OLD=... OUT=benchmarks/results/sessionNN bash benchmarks/ab_loop.sh, NEW and OLD each made by
# python benchmarks/import_tree.py CHECKOUT DIR (a link to convert/ alone runs the installed checkout's kernels and tables)
cd "$(dirname "$0")/.."

R=${OUT:?OUT: the folder for the JSON files}
for p in ${PRESETS:-bench-kimi-k25 bench-deepseek-v4 bench-qwen4-exp bench-glm5 bench-mistral-large-3 bench-deepseek-v3-2}; do
  IN=/tmp/ab34/in; rm -rf /tmp/ab34; mkdir -p /tmp/ab34
  PYTHONPATH=${NEW:?NEW: a folder whose kimi_convert links the new checkout} kimi-convert synth $p $IN > /dev/null
  python benchmarks/ab_pack.py -n ${N:-5} --evict $IN --json $R/ab-$p.json \
    --a "kimi-convert pack $IN /tmp/ab34/oa --device cpu -q --overwrite" --env-a PYTHONPATH=${NEW:?NEW: a folder whose kimi_convert links the new checkout} \
    --b "kimi-convert pack $IN /tmp/ab34/ob --device cpu -q --overwrite" --env-b PYTHONPATH=${OLD:?OLD: likewise the old one} 2>&1 | tail -6
  same=yes
  for f in /tmp/ab34/oa/*.safetensors /tmp/ab34/oa/manifest-records/*.jsonl; do
    cmp -s "$f" "/tmp/ab34/ob/${f#/tmp/ab34/oa/}" || same="no: $f"
  done
  echo "$p: shards and records files the same: $same"
done
rm -rf /tmp/ab34
