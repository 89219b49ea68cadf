"""Convert the built-in demo model to GGUF with llama.cpp's own `convert_hf_to_gguf.py`.

The demo tokenizer is GPT-2-style byte-level BPE, but its pre-tokenizer hash is not in
llama.cpp's table, so the converter is told that it is "gpt-2" (which it is). The GGUF
is written once into ``$TOKENTRAIL_CACHE/gguf/`` (never into the repository) and its
path printed. The converter comes from the llama.cpp tree bundled in the llama-cpp-python
sdist, which `scripts/build_llama_server.sh` unpacks into the same cache (or set
``TOKENTRAIL_LLAMA_CPP_SRC`` to a llama.cpp checkout). Needs torch and numpy.

    python scripts/demo_model_to_gguf.py [--outtype f32|f16|q8_0] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "src" / "tokentrail" / "demo_model"
VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")


def cache() -> Path:
    return Path(os.environ.get("TOKENTRAIL_CACHE") or Path.home() / ".cache" / "tokentrail")


def llama_cpp_src() -> Path:
    """The llama.cpp source tree that holds convert_hf_to_gguf.py."""
    env = os.environ.get("TOKENTRAIL_LLAMA_CPP_SRC")
    src = Path(env) if env else cache() / f"llama.cpp-{VERSION}" / "src"
    if not (src / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(
            f"demo_model_to_gguf: no convert_hf_to_gguf.py in {src}; run "
            "scripts/build_llama_server.sh (it unpacks llama.cpp there) or set "
            "TOKENTRAIL_LLAMA_CPP_SRC"
        )
    return src


def default_out(outtype: str) -> Path:
    h = hashlib.sha256((DEMO / "model.safetensors").read_bytes()).hexdigest()[:12]
    return cache() / "gguf" / f"tokentrail-demo-{h}-{outtype}.gguf"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outtype", default="f32", choices=("f32", "f16", "q8_0"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or default_out(args.outtype)
    if out.is_file():
        print(out)
        return 0
    src = llama_cpp_src()
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    # The bundled gguf-py matches the converter; prefer it over an installed gguf.
    sys.path[:0] = [str(src / "gguf-py"), str(src)]
    from conversion.base import TextModel  # llama.cpp's converter package

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = ["convert_hf_to_gguf.py", str(DEMO), "--outtype", args.outtype,
                "--outfile", str(part)]
    runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")
    part.replace(out)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
