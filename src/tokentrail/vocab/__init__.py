"""The tokenizer side: every supported format compiled into a `Vocab`.

Data flows one way, vocab -> align: nothing here imports the aligner. One module per
source format, its decode rules beside it:

- `core`: the `Vocab` class and the rules every format shares (clean-up of spaces,
  the byte-level alphabet, byte modes), `TokenizerLoadError`, the `reference` check.
- `detect`: `load_vocab`, which recognises a tokenizer object or path.
- `hf_json`: Hugging Face tokenizer.json (tokenizers decoder pipelines).
- `hf_objects`: transformers tokenizer objects.
- `bpe_folder`: vocab.json + merges.txt folders and class-defined folders.
- `spm`: SentencePiece models.
- `tiktoken_ranks`: tiktoken rank files and encodings.
- `tekken`: Mistral Tekken.
- `gguf_file`: GGUF files, with `gguf_llamacpp` (llama.cpp's decode rules) beside it.
- `llama2c`: llama2.c tokenizer.bin.
- `generic`: the path for decoder pipelines that are not per-token.
"""

from __future__ import annotations

from .core import TokenizerLoadError, Vocab
from .detect import load_vocab

__all__ = ["TokenizerLoadError", "Vocab", "load_vocab"]
