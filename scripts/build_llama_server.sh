#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama.cpp tree bundled in the llama-cpp-python
# sdist (the same llama.cpp the `llamacpp` engine runs), once, into a cache folder.
# Prints the path of the binary. About 10-15 minutes on 2 cores the first time; later
# calls return at once. Used by the tests that run a real llama-server and by benchmarks.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${TOKENTRAIL_CACHE:-$HOME/.cache/tokentrail}
ROOT="$CACHE/llama.cpp-$VERSION"
BIN="$ROOT/build/bin/llama-server"
if [ -x "$BIN" ]; then
  echo "$BIN"
  exit 0
fi
PY=${PYTHON:-python3}
mkdir -p "$ROOT"
SDIST_DIR="$ROOT/sdist"
if [ ! -d "$ROOT/src" ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SDIST_DIR" >&2
  rm -rf "$ROOT/unpack"
  mkdir -p "$ROOT/unpack"
  tar xzf "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz -C "$ROOT/unpack"
  mv "$ROOT/unpack/llama_cpp_python-$VERSION/vendor/llama.cpp" "$ROOT/src"
  rm -rf "$ROOT/unpack" "$SDIST_DIR"
fi
cmake -S "$ROOT/src" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
  -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$ROOT/build" -j"${JOBS:-2}" --target llama-server >&2
echo "$BIN"
