"""Model runtimes behind the `Engine` protocol.

`load_model(path, engine=...)` loads a model folder with the named engine and
`engine_for(model)` wraps an already loaded model. To add an engine, add a module with
`load(path, **options) -> (model, tokenizer)`, `accepts(model) -> bool` and
`wrap(model) -> Engine`, and list it in `ENGINES` (and its packages in `_PACKAGES`).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

from .base import Engine, Step

#: Engine name -> module implementing it (imported only when used).
ENGINES: dict[str, str] = {
    "llamacpp": "tokentrail.engines.llamacpp.engine",
    "mlx": "tokentrail.engines.mlx.engine",
    "torch": "tokentrail.engines.torch_engine",
    "vllm": "tokentrail.engines.vllm.engine",
}
#: Top-level packages whose classes each engine can run: `engine_for` imports an engine
#: (torch is slow to import) only for a model whose class comes from one of them.
_PACKAGES: dict[str, tuple[str, ...]] = {
    "llamacpp": ("llama_cpp",),
    "mlx": ("mlx", "mlx_lm"),
    "torch": ("torch", "transformers"),
    "vllm": ("vllm",),
}

__all__ = ["ENGINES", "Engine", "Step", "engine_for", "load_model"]


def _module(name: str) -> ModuleType:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; available engines: {', '.join(ENGINES)}")
    try:
        return importlib.import_module(ENGINES[name])
    except ImportError as e:
        raise ImportError(
            f"the {name!r} engine needs extra packages ({e.name or e}); install them with "
            f"pip install 'tokentrail[{name}]'"
        ) from e


def load_model(
    path: str | os.PathLike[str], engine: str = "mlx", **options: Any
) -> tuple[Any, Any]:
    """Load the model folder at `path` with `engine`; return (model, tokenizer).

    `options` go to the engine's own `load` (e.g. `device` and `dtype` for torch).
    """
    return _module(engine).load(path, **options)


def engine_for(model: Any) -> Engine:
    """The Engine that runs `model`: the model itself if it is one, else a wrapper."""
    if isinstance(model, Engine):
        return model
    packages = {c.__module__.partition(".")[0] for c in type(model).__mro__}
    for name in ENGINES:
        if name in _PACKAGES and packages.isdisjoint(_PACKAGES[name]):
            continue
        try:
            mod = _module(name)
        except ImportError:
            continue
        if mod.accepts(model):
            return mod.wrap(model)
    raise TypeError(
        f"no engine can run a model of type {type(model).__module__}.{type(model).__name__}; "
        "pass what tokentrail.load returns, an mlx-lm model, or an object implementing "
        "tokentrail.engines.Engine"
    )
