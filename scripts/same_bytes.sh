#!/usr/bin/env bash
# Same output bytes before and after a restructuring, with the kimi-convert on PATH.
#
#   scripts/same_bytes.sh pack DIR        pack every case below into DIR/<case> (synth inputs in DIR/in)
#   scripts/same_bytes.sh compare A B     cmp every file of A/<case> with B/<case>, manifest.json and
#                                         manifest-records/ left out (they name the tool's version and
#                                         paths); those are diffed and the differing lines printed
#
# Run `pack` on the old commit, `pack` on the new one, then `compare`. tests/test_same_bytes.py runs the
# same cases against the earlier code taken from git (BEFORE_22).
set -euo pipefail

CASES=(
  "tiny-k3|tiny-k3|"
  "tiny-k3-w4a16|tiny-k3|--recipe nvfp4-w4a16"
  "tiny-k3-sglang|tiny-k3|--layout sglang"
  "tiny-k3-vllm|tiny-k3|--layout vllm"
  "tiny-k3-w4a16-sglang|tiny-k3|--recipe nvfp4-w4a16 --layout sglang"
  "tiny-kimi-linear|tiny-kimi-linear|"
  "tiny-kimi-linear-w4a16|tiny-kimi-linear|--recipe nvfp4-w4a16"
  "tiny-kimi-linear-sglang|tiny-kimi-linear|--layout sglang"
  "tiny-kimi-linear-vllm|tiny-kimi-linear|--layout vllm"
  "tiny-deepseek-fp8|tiny-deepseek-fp8|"
  "tiny-deepseek-fp8-w4a16|tiny-deepseek-fp8|--recipe nvfp4-w4a16"
  "tiny-deepseek-fp8-sglang|tiny-deepseek-fp8|--layout sglang"
  "tiny-deepseek-fp8-vllm|tiny-deepseek-fp8|--layout vllm"
)

# a built-in preset by name, the tests' by their spec file (tests/presets/, docs/presets.md)
TEST_PRESETS="$(cd "$(dirname "$0")/.." && pwd)/tests/presets"
spec() {
  python -c "import sys; from kimi_convert.synth import find_preset; print(find_preset(sys.argv[1], [sys.argv[2]]))" \
    "$1" "$TEST_PRESETS"
}

pack() {
  local dir=$1
  mkdir -p "$dir/in"
  for c in "${CASES[@]}"; do
    IFS='|' read -r name preset opts <<<"$c"
    [ -d "$dir/in/$preset" ] || kimi-convert synth "$(spec "$preset")" "$dir/in/$preset" >/dev/null
    # shellcheck disable=SC2086
    TQDM_DISABLE=1 kimi-convert pack "$dir/in/$preset" "$dir/$name" --device cpu -q --overwrite $opts
    # shellcheck disable=SC2086
    kimi-convert plan "$dir/in/$preset" $opts --json > "$dir/$name/plan.json"
  done
}

compare() {
  local a=$1 b=$2 bad=0
  for c in "${CASES[@]}"; do
    IFS='|' read -r name _ _ <<<"$c"
    local fa fb
    fa=$(cd "$a/$name" && find . -type f | sort)
    fb=$(cd "$b/$name" && find . -type f | sort)
    if [ "$fa" != "$fb" ]; then echo "$name: different file lists"; bad=1; continue; fi
    local n=0
    while read -r f; do
      case "$f" in
        ./plan.json)  # the same JSON; its text layout changed with issue 22 (one module a line)
          python3 -c 'import json, sys; sys.exit(json.load(open(sys.argv[1])) != json.load(open(sys.argv[2])))' \
            "$a/$name/$f" "$b/$name/$f" || { echo "$name: plan.json differs"; bad=1; } ;;
        ./manifest.json|./manifest-records/*)
          if ! cmp -s "$a/$name/$f" "$b/$name/$f"; then
            echo "$name: $f differs (manifest: shown, not failed):"
            diff <(tr ',' '\n' <"$a/$name/$f") <(tr ',' '\n' <"$b/$name/$f") | head -20 || true
          fi ;;
        *) n=$((n + 1)); cmp "$a/$name/$f" "$b/$name/$f" || bad=1 ;;
      esac
    done <<<"$fa"
    echo "$name: $n files compared"
  done
  [ $bad = 0 ] && echo "same bytes" || { echo "DIFFERENT"; exit 1; }
}

"$@"
