#!/usr/bin/env bash
# Pack every tiny preset with each recipe into DEST (DEST/<preset>-<recipe>/), so that two trees, one made
# before a change and one after, can be compared file for file:  scripts/same_bytes.sh /tmp/before; (change);
# scripts/same_bytes.sh /tmp/after; diff -r /tmp/before /tmp/after (cmp of every file, manifest.json included).
set -euo pipefail
dest=${1:?usage: same_bytes.sh DEST}
mkdir -p "$dest"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"  # every path relative: the manifest names no folder of this run
for preset in tiny-k3 tiny-kimi-linear tiny-deepseek-fp8; do
  kimi-convert synth "$preset" in --overwrite >/dev/null
  for recipe in default nvfp4-w4a16; do
    args=()
    [ "$recipe" = default ] || args=(--recipe "$recipe")
    out="$dest/$preset-$recipe"
    rm -rf "$out"
    kimi-convert pack in "$out" --device cpu "${args[@]}" --overwrite >/dev/null 2>&1 || {
      echo "pack $preset $recipe failed"; kimi-convert pack in "$out" --device cpu "${args[@]}" --overwrite; exit 1; }
    kimi-convert plan in "${args[@]}" --json > "$dest/$preset-$recipe.plan.json"
  done
  rm -rf in
done
echo "packed into $dest"
