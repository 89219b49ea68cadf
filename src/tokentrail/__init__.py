"""tokentrail: streamed text where every piece carries the exact tokens that made it."""

from __future__ import annotations

from typing import Any

from .align import Aligner
from .segment import Alternative, Confidence, Segment, TokenSpan, confidence_of
from .vocab import TokenizerLoadError, Vocab, load_vocab

__version__ = "0.1.0"

__all__ = [
    "Aligner",
    "Alternative",
    "Confidence",
    "Segment",
    "TokenSpan",
    "TokenizerLoadError",
    "Vocab",
    "confidence_of",
    "load_vocab",
]


def __getattr__(name: str) -> Any:
    # Heavy parts (MLX, transformers) load only when asked for.
    if name in ("load", "stream_generate", "GenerationResponse"):
        from . import generate

        return getattr(generate, name)
    if name == "StreamingDetokenizer":
        from .detokenizer import StreamingDetokenizer

        return StreamingDetokenizer
    raise AttributeError(f"module 'tokentrail' has no attribute {name!r}")
