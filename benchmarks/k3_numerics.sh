#!/usr/bin/env bash
# K3's mid-tile question at release width (docs/engines.md, "Numerics"): bench-k3 (hidden 7168, q_lora 1536,
# kv_lora 512 + rope 64, one MLA layer; --experts 2 keeps it at 1.5 GB) packed with the default recipe in
# NVIDIA's layout and with --layout vllm, then the numeric check in vLLM. (SGLang 0.5.23 does not load
# bench-k3: its layer 0 is MoE, first_dense 0, where the release's is dense, and SGLang builds that layer's
# experts at the hidden size; tiny-k3, laid out as the release, is SGLang's row in docs/engines.md.)
# Prints, per run, the verdict and the MLA fused layers' max / mean relative error against their bound.
#   bash benchmarks/k3_numerics.sh [WORKDIR]      (about 6 minutes and 15 GB of memory on 2 cores)
set -euo pipefail
w=${1:-/tmp/k3-numerics}
mkdir -p "$w"
kimi-convert synth bench-k3 "$w/in" --experts 2 --overwrite
kimi-convert pack "$w/in" "$w/nvidia" -q --overwrite
kimi-convert pack "$w/in" "$w/vllm-layout" --layout vllm -q --overwrite
report() {  # OUT ENGINE
    kimi-convert verify-manifest "$w/$1" --input "$w/in" --engine "$2" --json -q > "$w/$1-$2.json" || true
    python3 - "$w/$1-$2.json" "$1" <<'PY'
import json, sys
e = json.load(open(sys.argv[1]))["engines"][0]
print(f"{sys.argv[2]}: {e['verdict'][:300]}")
for layer in e["numerics"]["layers"]:
    if "qkv_a" in layer["engine_param"]:
        print(f"  {layer['engine_param']}: {layer['rows']} rows, max {layer['max_rel_err']:.3g}, "
              f"mean {layer['mean_rel_err']:.3g}, bound {layer['max_bound']:.3g}")
PY
}
report nvidia vllm
report vllm-layout vllm
