"""GGUF model files: finding them, explaining why one cannot run, and opening them in
engines other than llama.cpp.

* `gguf_source(path)` says whether a model argument means a GGUF file: a path ending in
  ``.gguf`` or a name from `tokentrail.models` (``smollm2``).
* `check_gguf(path, engine)` reads the file's header (with the `gguf` package, llama.cpp's
  own reader) and raises `GGUFError` naming the file and what to do when the file is not
  a GGUF, is cut short, holds a vocabulary but no weights, or uses an architecture or a
  quantization type the engine cannot run.
* `transformers_from_gguf` loads a GGUF with transformers (``from_pretrained(folder,
  gguf_file=...)``, which dequantizes to float32) for the torch engine, and
  `mlx_folder_from_gguf` turns one into a Hugging Face folder once, cached, for mlx-lm.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import GGUFError
from .config import attach_eos_ids, model_eos_ids

log = logging.getLogger(__name__)

__all__ = [
    "GGUFError",
    "GGUFInfo",
    "check_gguf",
    "gguf_source",
    "mlx_folder_from_gguf",
    "read_gguf_header",
    "transformers_from_gguf",
]

GGUF_MAGIC = b"GGUF"


@dataclass
class GGUFInfo:
    """What the header of a GGUF file says."""

    path: Path
    architecture: str | None
    n_tensors: int
    tensor_types: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)


def gguf_source(path: str | os.PathLike[str] | None) -> Path | None:
    """The GGUF file `path` stands for, or None if it is not a GGUF model argument.

    A named model (``smollm2``) resolves through `tokentrail.models.resolve` (which
    raises `ModelNotAvailable`, a FileNotFoundError, saying how to fetch it); a path
    whose name ends in ``.gguf`` is returned as is (checked later); anything else, e.g.
    a Hugging Face folder, gives None.
    """
    if path is None:
        return None
    from ..models import is_named, resolve

    if is_named(path) and not Path(str(path)).exists():
        return resolve(str(path))
    p = Path(path).expanduser()
    if p.suffix.lower() == ".gguf":
        return p
    return None


def _first_bytes(p: Path) -> bytes:
    if not p.exists():
        raise FileNotFoundError(f"GGUF model file not found: {p}")
    if not p.is_file():
        raise GGUFError(f"{p} is not a file; pass the .gguf model file itself")
    with open(p, "rb") as f:
        return f.read(4)


def check_magic(p: Path) -> None:
    """Raise unless `p` exists and starts like a GGUF file (cheap: reads 4 bytes)."""
    if _first_bytes(p) != GGUF_MAGIC:
        raise GGUFError(
            f"{p} is not a GGUF file (it does not start with the GGUF magic bytes); "
            "pass a .gguf model file, or a Hugging Face folder with another engine"
        )


def read_gguf_header(p: Path) -> GGUFInfo:
    """Read a GGUF header with the `gguf` package; GGUFError for a broken file.

    (Not `tokentrail.vocab.gguf_file.read_gguf`, which reads a GGUF's tokenizer.)"""
    check_magic(p)
    try:
        import gguf
    except ImportError as e:
        raise ImportError(
            "reading GGUF files needs the gguf package: pip install 'tokentrail[gguf]'"
        ) from e
    size = p.stat().st_size
    try:
        reader = gguf.GGUFReader(str(p))
    except ValueError as e:
        if "GGMLQuantizationType" in str(e):
            raise GGUFError(
                f"{p} uses a tensor type this gguf/llama.cpp version does not know ({e}); "
                "upgrade llama-cpp-python and gguf, or use a file quantized to a common type "
                "such as Q4_K_M or Q8_0"
            ) from e
        raise GGUFError(
            f"{p} is truncated or corrupt ({size} bytes; the header cannot be read: {e}); "
            "download the file again"
        ) from e
    except (OSError, IndexError, KeyError, EOFError) as e:
        raise GGUFError(f"{p} is truncated or corrupt ({size} bytes: {e})") from e
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise GGUFError(
            f"{p} is truncated: its tensors need {end} bytes but the file has {size}; "
            "download the file again"
        )
    meta: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.model",):
            continue  # the vocabulary arrays: large and not needed here
        try:
            meta[name] = fld.contents()
        except Exception:  # an exotic field type: leave it out, it is informative only
            continue
    arch = meta.get("general.architecture")
    types = {t.name: int(t.tensor_type) for t in reader.tensors}
    return GGUFInfo(p, arch if isinstance(arch, str) else None, len(reader.tensors), types, meta)


#: The old name of `read_gguf_header`, kept importable.
read_gguf = read_gguf_header


def _type_name(value: int) -> str:
    try:
        import gguf

        return gguf.GGMLQuantizationType(value).name
    except (ImportError, ValueError):
        return str(value)


def check_gguf(p: Path, engine: str, info: GGUFInfo | None = None) -> GGUFInfo:
    """Raise GGUFError unless `engine` ("llamacpp", "torch", "mlx") can run the file."""
    info = info if info is not None else read_gguf_header(p)
    if info.n_tensors == 0:
        raise GGUFError(
            f"{p} is a vocabulary-only GGUF (it has no weight tensors): it cannot generate "
            "text; use it as a tokenizer (tokentrail align --tokenizer FILE) or download the "
            "full model file"
        )
    if info.architecture is None:
        raise GGUFError(f"{p} has no general.architecture; it is not a model file")
    if engine in ("torch", "mlx"):
        try:
            from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
        except ImportError as e:
            raise ImportError(
                f"loading {p} with the {engine} engine needs transformers and gguf: "
                f"pip install 'tokentrail[{engine},gguf]' accelerate"
            ) from e
        if info.architecture not in GGUF_SUPPORTED_ARCHITECTURES:
            raise GGUFError(
                f"{p}: transformers cannot load GGUF architecture {info.architecture!r} "
                f"(it loads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}); "
                "use --engine llamacpp"
            )
        from gguf.quants import GGMLQuantizationType as Q

        runnable = {Q.F32, Q.F16, Q.BF16}
        bad = sorted(
            {v for v in info.tensor_types.values() if v not in runnable and not _dequantizable(v)}
        )
        if bad:
            names = ", ".join(_type_name(v) for v in bad)
            raise GGUFError(
                f"{p} uses quantization type {names}, which the gguf package cannot "
                f"dequantize for the {engine} engine; use --engine llamacpp"
            )
    return info


@functools.cache
def _dequantizable(value: int) -> bool:
    """Whether the `gguf` package can dequantize tensor type `value`: asked through its
    public `gguf.quants.dequantize` on one all-zero block (it raises NotImplementedError
    for a type it has no dequantizer for)."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import GGMLQuantizationType, dequantize

    try:
        q = GGMLQuantizationType(value)
        _, type_size = GGML_QUANT_SIZES[q]
        with np.errstate(all="ignore"):
            dequantize(np.zeros(type_size, dtype=np.uint8), q)
    except (ValueError, KeyError, NotImplementedError):
        return False
    return True


def explain_llamacpp_failure(p: Path, error: Exception) -> GGUFError:
    """Why llama.cpp refused to load `p` (it only says "failed to load"), as one error."""
    try:
        info = check_gguf(p, "llamacpp")
    except GGUFError as e:
        return e
    except ImportError:
        return GGUFError(
            f"llama.cpp cannot load {p} ({error}); install gguf (pip install gguf) for a "
            "precise reason"
        )
    return GGUFError(
        f"llama.cpp cannot load {p}: architecture {info.architecture!r} or one of its "
        f"tensors is not supported by this llama-cpp-python ({error}); upgrade "
        "llama-cpp-python, or try --engine torch"
    )


# -- other engines -----------------------------------------------------------------------


def _split(p: Path) -> tuple[str, str]:
    return str(p.resolve().parent), p.name


def transformers_from_gguf(
    p: Path, *, engine: str = "torch", **model_kwargs: Any
) -> tuple[Any, Any]:
    """(model, tokenizer) from transformers' GGUF loader; the model dequantizes to float32.

    The tokenizer gets `eos_token_ids` from the generation config, else the model config
    (`tokentrail.engines.config.model_eos_ids`, as torch_engine's tokenizers), so chat
    models stop at their end-of-turn token. `engine` only names the engine in error
    messages.
    """
    check_gguf(p, engine)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # checked by check_gguf, but keep the message precise
        raise ImportError("loading GGUF with transformers needs pip install transformers") from e
    folder, name = _split(p)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **model_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ImportError as e:
        raise ImportError(
            f"transformers needs more packages to load {p} ({e}): pip install accelerate gguf"
        ) from e
    except (ValueError, NotImplementedError, KeyError, OSError) as e:
        raise GGUFError(f"transformers cannot load {p}: {e}; try --engine llamacpp") from e
    return model, attach_eos_ids(tokenizer, model_eos_ids(model))


def _cache_root() -> Path:
    root = os.environ.get("TOKENTRAIL_CACHE") or Path.home() / ".cache" / "tokentrail"
    return Path(root) / "mlx-from-gguf"


def _file_key(p: Path) -> str:
    st = p.stat()
    h = hashlib.sha256(f"{p.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode())
    return f"{p.stem}-{h.hexdigest()[:12]}"


def mlx_folder_from_gguf(p: Path) -> Path:
    """A Hugging Face folder (float32 safetensors, as transformers dequantizes) made
    from `p` once, for mlx-lm.

    transformers dequantizes the GGUF; `save_pretrained` refuses a model that still
    carries its GGUF quantizer, so that is cleared first. transformers 5 writes
    `rope_theta` only inside `rope_parameters`, and mlx-lm then silently uses 10000, so
    it is also written at the top level of config.json. The folder is cached under
    ``$TOKENTRAIL_CACHE/mlx-from-gguf`` keyed by the file's path, size and mtime.
    """
    check_gguf(p, "mlx")
    out = _cache_root() / _file_key(p)
    if (out / "config.json").is_file() and any(out.glob("model*.safetensors")):
        return out
    log.info("converting %s to a Hugging Face folder for mlx-lm at %s (once)", p, out)
    import torch

    model, tokenizer = transformers_from_gguf(p, engine="mlx", dtype=torch.float32)
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(model, attr, None)
    cfg = model.config
    for attr in ("quantization_config",):
        if hasattr(cfg, attr):
            with contextlib.suppress(AttributeError, TypeError):
                delattr(cfg, attr)
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    config_file = tmp / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    rope = config.get("rope_parameters")
    if "rope_theta" not in config and isinstance(rope, dict) and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    config_file.write_text(json.dumps(config, indent=2), encoding="utf-8")
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out

