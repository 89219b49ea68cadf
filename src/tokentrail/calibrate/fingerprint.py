"""Which model a calibration belongs to: hashes of its tokenizer and its weights.

- ``tokenizer``: SHA-256 of every token's bytes, in id order (with each id's special
  flag), from the tokenizer compiled by `tokentrail.prompting.vocab_for`: the same for
  the same vocabulary whatever file it was read from.
- ``weights``: for a model file (llama.cpp's GGUF), SHA-256 of its size and its first
  and last 4 MiB; for an in-process MLX or torch model, SHA-256 of its parameters'
  names, shapes and dtypes and the first 4096 values of each. Cheap (a fraction of a
  second) and stable; not a proof against a crafted file.
- ``name``: what to call it in messages (the file or folder name, or a server's id).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from ..engines import engine_for
from ..prompting import vocab_for
from ..weakid import IdWeakMap

log = logging.getLogger(__name__)

__all__ = ["calibration_for", "file_digest", "model_fingerprint", "tokenizer_digest"]

_CHUNK = 4 << 20
_VALUES = 4096


def tokenizer_digest(tokenizer: Any) -> str:
    """SHA-256 of the compiled vocabulary's bytes per id."""
    vocab = vocab_for(tokenizer)
    h = hashlib.sha256()
    for i, piece in enumerate(vocab.pieces):
        h.update(b"\x01" if i in vocab.special else b"\x00")
        if piece is None:
            h.update(b"\xff\xff\xff\xff")
        else:
            h.update(len(piece).to_bytes(4, "little") + piece)
    return h.hexdigest()


def file_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file's size and its first and last 4 MiB."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with p.open("rb") as f:
        h.update(f.read(_CHUNK))
        if size > _CHUNK:
            f.seek(max(_CHUNK, size - _CHUNK))
            h.update(f.read(_CHUNK))
    return h.hexdigest()


def _arrays_digest(named: list[tuple[str, Any]], to_numpy: Any) -> str:
    h = hashlib.sha256()
    for name, value in sorted(named, key=lambda kv: kv[0]):
        arr = to_numpy(value)
        h.update(f"{name}|{tuple(arr.shape)}|{arr.dtype}\n".encode())
        h.update(arr.reshape(-1)[:_VALUES].tobytes())
    return h.hexdigest()


def _weights_digest(engine: Any) -> str | None:
    path = getattr(engine, "model_path", None)
    if isinstance(path, str) and os.path.isfile(path):
        return file_digest(path)
    model = getattr(engine, "model", None)
    if model is None:
        return None
    if engine.name == "mlx":
        import mlx.core as mx
        import numpy as np
        from mlx.utils import tree_flatten

        def to_np(a: Any) -> Any:
            return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)

        return _arrays_digest(tree_flatten(model.parameters()), to_np)
    if engine.name == "torch":
        return _arrays_digest(
            list(model.state_dict().items()), lambda t: t.detach().float().cpu().numpy()
        )
    return None


def model_fingerprint(model: Any, tokenizer: Any, name: str = "") -> dict[str, Any]:
    """The fingerprint of a loaded model (what `tokentrail.load` returned)."""
    engine = engine_for(model)
    try:
        weights = _weights_digest(engine)
    except Exception as e:  # a runtime without the expected attributes: no weights hash
        log.info("no weights fingerprint for the %s engine: %s", engine.name, e)
        weights = None
    if not name:
        path = getattr(engine, "model_path", None)
        name = Path(path).name if isinstance(path, str) else engine.name
    return {
        "name": name,
        "engine": engine.name,
        "tokenizer": tokenizer_digest(tokenizer),
        "weights": weights,
    }


def calibration_for(calibration: Any, model: Any, tokenizer: Any) -> Any:
    """`calibration` (a `Calibration` or its file) checked against this model's
    fingerprint (once per model and tokenizer): a map fitted for another model is a
    CalibrationError."""
    from .apply import Calibration

    cal = calibration if isinstance(calibration, Calibration) else Calibration.load(calibration)
    tokenizers = cal.checked.get(model)
    if tokenizers is None or tokenizers.get(tokenizer) is None:
        cal.check(model_fingerprint(model, tokenizer))
        if tokenizers is None:
            tokenizers = IdWeakMap()
        # Either not weakly referable: checked again on the next call.
        if tokenizers.put(tokenizer, True):
            cal.checked.put(model, tokenizers)
    return cal
