#!/usr/bin/env bash
# Builds llama-server from the llama.cpp that llama-cpp-python $LLAMA_CPP_PYTHON vendors (its sdist
# carries vendor/llama.cpp), so the server and the Python bindings write the same state format.
# The one place the build is written: scripts/setup.sh and llama_cachegen.server both run it (it
# lives in the package so that an installed llama-cachegen finds it too).
# CPU only, static (no shared libraries to carry), no curl, no OpenSSL, no web UI download;
# ~4-5 minutes on 2 cores, once: the binary is kept in $CACHE/llama-server-<version>/.
# Prints the binary's path on stdout; everything else goes to stderr.
set -euo pipefail

LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
CACHE=${LLAMA_CACHEGEN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-cachegen}
PYTHON=${PYTHON:-python3}
DEST=$CACHE/llama-server-$LLAMA_CPP_PYTHON
BIN=$DEST/llama-server

log() { printf '\033[1m[llama-server]\033[0m %s\n' "$*" >&2; }

if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
    echo "$BIN"
    exit 0
fi

# The sdist (~75 MB) is kept too: a rebuild (another compiler, a wiped build) needs no network.
mkdir -p "$CACHE/sdist"
sdist=$CACHE/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz
if [ ! -f "$sdist" ]; then
    log "downloading the llama-cpp-python $LLAMA_CPP_PYTHON sdist (for its vendored llama.cpp)"
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: \
        "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$CACHE/sdist"
fi

# One build at a time per cache: a second caller waits, then finds the binary.
exec 9>"$CACHE/llama-server-$LLAMA_CPP_PYTHON.lock"
flock 9
if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
    echo "$BIN"
    exit 0
fi

work=$(mktemp -d "$CACHE/llama-server-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
log "building llama-server from llama-cpp-python $LLAMA_CPP_PYTHON (once; ~4-5 min on 2 cores)"
tar -xzf "$sdist" -C "$work"
src=$work/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
cmake --build "$work/build" --target llama-server -j"$(nproc)" >&2
mkdir -p "$DEST"
install -m 755 "$work/build/bin/llama-server" "$BIN.tmp"
mv -f "$BIN.tmp" "$BIN"
log "cached $BIN"
echo "$BIN"
