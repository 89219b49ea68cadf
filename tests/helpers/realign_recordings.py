"""The real llama-server recordings in tests/data/realign (llama.cpp's ``/completion``,
``/v1/completions`` and ``/v1/chat``, the demo model's and SmolLM2's), for tests that
read them all."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tests.helpers.llamacpp import find_smollm2
from tokentrail import load_vocab

DATA = Path(__file__).resolve().parents[1] / "data" / "realign"
DEMO_MODEL = Path(__file__).resolve().parents[2] / "src" / "tokentrail" / "demo_model"
FOLDERS = ("llamacpp_demo", "llamacpp", "llamacpp_folds")


def llama_recordings() -> list[tuple[str, dict[str, Any]]]:
    """(folder, manifest entry) of every recording."""
    out = []
    for folder in FOLDERS:
        manifest = json.loads((DATA / folder / "MANIFEST.json").read_text("utf-8"))
        out += [(folder, rec) for rec in manifest["recordings"]]
    return out


@functools.cache
def recording_vocab(folder: str) -> Any:
    """The vocabulary a folder's recordings were made with."""
    return load_vocab(DEMO_MODEL if folder == "llamacpp_demo" else find_smollm2())


def recording_chunks(folder: str, rec: dict[str, Any]) -> list[Any]:
    """A recording's chunks, parsed."""
    lines = (DATA / folder / rec["file"]).read_text("utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
