#!/usr/bin/env bash
# Create the serving engines' own virtual environments, used by `verify-manifest --engine` and the
# engine tests. Idempotent: an environment that already imports the pinned version is left alone.
# The tool never installs an engine itself; this script is the one place that does.
#
#   scripts/engine-envs.sh [vllm] [sglang]      (default: both, in parallel)
#   KIMI_CONVERT_ENGINE_ENVS=DIR                 (default: ~/.cache/kimi-convert/engines)
set -uo pipefail
VLLM_VERSION=0.33.0
SGLANG_VERSION=0.5.23
root="${KIMI_CONVERT_ENGINE_ENVS:-$HOME/.cache/kimi-convert/engines}"
python="${PYTHON:-python3}"
mkdir -p "$root"

make_env() {  # name version pip-spec...
    local name=$1 version=$2; shift 2
    local env="$root/$name-$version"
    if [ -x "$env/bin/python" ] && "$env/bin/python" - "$name" "$version" <<'PY' 2>/dev/null; then
import importlib.metadata as m, sys
sys.exit(0 if m.version(sys.argv[1]) == sys.argv[2] else 1)
PY
        echo "$name $version: ready at $env"
        return 0
    fi
    echo "$name $version: creating $env (several GB, 10-20 minutes)"
    rm -rf "$env.partial"
    "$python" -m venv "$env.partial" || return 1
    "$env.partial/bin/python" -m pip install -q --upgrade pip || return 1
    "$env.partial/bin/python" -m pip install -q "$@" >"$root/$name.log" 2>&1 || {
        echo "$name $version: pip failed, see $root/$name.log"; return 1; }
    # venv scripts hold absolute paths: recreate the venv's own files at the final path.
    rm -rf "$env" && mv "$env.partial" "$env" && "$python" -m venv --upgrade "$env" >/dev/null || return 1
    echo "$name $version: ready at $env"
}

engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(vllm sglang)
pids=()
for e in "${engines[@]}"; do
    case $e in
        vllm) make_env vllm "$VLLM_VERSION" "vllm==$VLLM_VERSION" & pids+=($!) ;;
        sglang) make_env sglang "$SGLANG_VERSION" "sglang==$SGLANG_VERSION" & pids+=($!) ;;
        *) echo "unknown engine '$e' (expected vllm or sglang)"; exit 2 ;;
    esac
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
