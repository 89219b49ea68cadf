"""GGUF vocabularies written with the gguf package, for the rules no corpus file covers."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def vocab_writer(path: Path, model: str) -> Any:
    """A `gguf.GGUFWriter` for a one-block `llama` GGUF whose tokenizer model is `model`
    (add the token list, types, ... then `finish` it)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.context_length", 512)
    w.add_uint32("llama.embedding_length", 64)
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.feed_forward_length", 64)
    w.add_uint32("llama.attention.head_count", 1)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model(model)
    return w


def finish(w: Any) -> None:
    """Write the header, metadata and (no) tensors of `w`, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
