"""tokentrail: streamed text where every piece carries the exact tokens that made it.

The light parts (the aligner, vocabularies, segments) import at once; the parts that
pull in a model runtime or a web stack (`load`, `stream_generate`, the mlx-lm drop-in
detokenizer, the stream re-aligner) are reachable from here too but load only when
first asked for, so `import tokentrail` stays fast and needs no optional extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .align import Aligner
from .segment import Alternative, Confidence, Segment, TokenSpan, confidence_of
from .vocab import TokenizerLoadError, Vocab, load_vocab

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from .batch import batch_generate, stream_batch_generate
    from .detokenizer import StreamingDetokenizer
    from .generate import DEMO_MODEL, GenerationResponse, load, stream_generate
    from .output.vote import vote
    from .realign import Realigner, RealignError

__version__ = "0.1.0"

#: Public names loaded on first access: name -> module (relative to this package).
#: (`tokentrail.realign` is the module: a lazy function of that name would be shadowed
#: by the submodule as soon as it is imported.)
_LAZY = {
    "DEMO_MODEL": ".generate",
    "GenerationResponse": ".generate",
    "load": ".generate",
    "stream_generate": ".generate",
    "batch_generate": ".batch",
    "stream_batch_generate": ".batch",
    "StreamingDetokenizer": ".detokenizer",
    "RealignError": ".realign",
    "Realigner": ".realign",
    "vote": ".output.vote",
}

__all__ = [
    "DEMO_MODEL",
    "Aligner",
    "Alternative",
    "Confidence",
    "GenerationResponse",
    "RealignError",
    "Realigner",
    "Segment",
    "StreamingDetokenizer",
    "TokenSpan",
    "TokenizerLoadError",
    "Vocab",
    "__version__",
    "batch_generate",
    "confidence_of",
    "load",
    "load_vocab",
    "stream_batch_generate",
    "stream_generate",
    "vote",
]


def __getattr__(name: str) -> Any:
    """Import the module behind a lazy public name on first use (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tokentrail' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    """Module attributes plus the lazy names, so completion offers them before first use."""
    return sorted(set(globals()) | set(_LAZY))
