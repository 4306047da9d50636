#!/usr/bin/env bash
# The same output on the CPU and the GPU: synth each preset, pack it with --device cpu and --device cuda,
# cmp every file of the two outputs (manifest included). Prints "same" or "DIFF" per file; exit 1 on a DIFF.
#
#     bash benchmarks/devices_same_bytes.sh tiny-gpt-oss bench-gpt-oss      # on the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
WORK=${WORKDIR:-/tmp/kimi-convert-devices}
status=0
for p in "$@"; do
    # a built-in preset by name, the tests' (tiny-gpt-oss) by their spec file in tests/presets/
    spec=$("$PY" -c "import sys; from kimi_convert.synth import find_preset; print(find_preset(sys.argv[1], ['tests/presets']))" "$p")
    "$PY" -m kimi_convert.cli synth "$spec" "$WORK/$p" --overwrite >/dev/null
    for d in cpu cuda; do "$PY" -m kimi_convert.cli pack "$WORK/$p" "$WORK/$p-$d" --device "$d" -q --overwrite; done
    for f in "$WORK/$p-cpu"/*; do
        [ -f "$f" ] || continue
        if cmp -s "$f" "$WORK/$p-cuda/$(basename "$f")"; then echo "same $p $(basename "$f")"
        else echo "DIFF $p $(basename "$f")"; status=1; fi
    done
done
exit $status
