"""Shared test helpers, imported as `from tests.helpers.<module> import ...`.

- `env`: the repository and the tokenizer corpus, `require` (skip naming the extra to
  install), `missing` (skip locally, fail in CI) and llama-cpp-python's check.
- `net`: `free_port`.
- `servers`: start a server process, wait until it answers, stop it (`Server`).
- `models`: the one tiny random-weight Llama builder and its tokenizer files.
- `responses`: checks on what the OpenAI-compatible server streams.
- `generation`: checks on `stream_generate`'s responses.
- `tokenizer_specs`: the tokenizers of the alignment tests, built from the corpus.
- `gguf_files`: writing GGUF vocabularies with the gguf package.
- `recordings`: the ground truth behind tests/data/realign's recordings.

Nothing here imports an optional extra at import time: a helper that needs one imports it
when called, so no test skips because an unrelated extra is missing.
"""
