#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-completion (the plain-text completion tool: in this llama.cpp,
# llama-cli is the chat front end of the server) and llama-server (its OpenAI-compatible HTTP server,
# which `kvrelay bench serve --url` drives beside a kvrelay stack) from the llama-cpp-python source
# distribution on PyPI (the only place this machine can get llama.cpp from), for `kvrelay bench engine
# --peer llama.cpp PATH` and `kvrelay bench agreement LLAMA_COMPLETION` (docs/performance.md). Never run
# in CI: it downloads ~77 MB and compiles for about 6 minutes on 2 cores.
#
#   scripts/build_llama_bench.sh [OUT_DIR]        # default: build/llama.cpp; prints the three binaries
#
# -DGGML_NATIVE=ON compiles for this CPU (as a user of llama.cpp would); the web UI download is switched off.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
OUT="$(realpath -m "${1:-build/llama.cpp}")"
PYTHON="${PYTHON:-.venv/bin/python}"
mkdir -p "$OUT"

if [[ ! -d "$OUT/src" ]]; then
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$OUT/dist"
    mkdir -p "$OUT/src"
    tar -xzf "$OUT/dist/llama_cpp_python-$VERSION.tar.gz" -C "$OUT/src" --strip-components=1
fi

GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
cmake -S "$OUT/src/vendor/llama.cpp" -B "$OUT/cmake" "${GENERATOR[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >/dev/null
cmake --build "$OUT/cmake" -j "$(nproc)" --target llama-bench llama-completion llama-server

echo "$OUT/cmake/bin/llama-bench"
echo "$OUT/cmake/bin/llama-completion"
echo "$OUT/cmake/bin/llama-server"
