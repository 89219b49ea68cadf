"""The real llama-server recordings in tests/data/realign (llama.cpp's ``/completion``,
``/v1/completions`` and ``/v1/chat``, the demo model's and SmolLM2's), and the real vLLM
ones (``/v1/completions`` as the proxy asks vLLM, the demo model's), for tests that read
them all."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.helpers.llamacpp import find_smollm2
from tokentrail import load_vocab
from tokentrail.realign import Realigner, RealignError

DATA = Path(__file__).resolve().parents[1] / "data" / "realign"
DEMO_MODEL = Path(__file__).resolve().parents[2] / "src" / "tokentrail" / "demo_model"
FOLDERS = ("llamacpp_demo", "llamacpp", "llamacpp_folds")
VLLM_FOLDERS = ("vllm_demo",)
#: The folders whose recordings are the demo model's (the rest are SmolLM2's).
DEMO_FOLDERS = ("llamacpp_demo", "vllm_demo")


def llama_recordings() -> list[tuple[str, dict[str, Any]]]:
    """(folder, manifest entry) of every llama-server recording."""
    return _recordings(FOLDERS)


def vllm_recordings() -> list[tuple[str, dict[str, Any]]]:
    """(folder, manifest entry) of every vLLM recording."""
    return _recordings(VLLM_FOLDERS)


def _recordings(folders: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for folder in folders:
        manifest = json.loads((DATA / folder / "MANIFEST.json").read_text("utf-8"))
        out += [(folder, rec) for rec in manifest["recordings"]]
    return out


@functools.cache
def recording_vocab(folder: str) -> Any:
    """The vocabulary a folder's recordings were made with."""
    return load_vocab(DEMO_MODEL if folder in DEMO_FOLDERS else find_smollm2())


def recording_chunks(folder: str, rec: dict[str, Any]) -> list[Any]:
    """A recording's chunks, parsed."""
    lines = (DATA / folder / rec["file"]).read_text("utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def realign_both_ways(
    vocab: Any, chunks: list[Any], segments: bool, direct: bool, method: str
) -> tuple[tuple[Any, ...], int]:
    """Everything a caller sees of one stream, read with a `Realigner` whose direct read
    `method` (``_plain_token``, ``_plain_ids_token``) is on (`direct`) or turned down:
    ((events, segments fed and finished, result), or ("error", message, events)), and
    how many frames it read directly."""
    events: list[Any] = []
    r = Realigner(vocab, on_token=events.append, segments=segments)
    taken = 0
    own = getattr(r, method)

    def counted(plain: Any) -> bool:
        nonlocal taken
        ok = bool(own(plain)) if direct else False
        taken += ok
        return ok

    setattr(r, method, counted)
    try:
        fed = [seg for chunk in chunks for seg in r.feed(copy.deepcopy(chunk))]
        fed += r.finish()
        outcome: tuple[Any, ...] = (events, fed, r.result())
    except RealignError as e:
        outcome = ("error", str(e), events)
    return outcome, taken


def read_both_ways(
    folder: str,
    rec: dict[str, Any],
    segments: bool,
    method: str,
    changes: Sequence[tuple[int, str, int]] = (),
    alter: Callable[[dict[str, Any], str, int, int], None] | None = None,
) -> tuple[tuple[Any, ...], tuple[Any, ...], int]:
    """(direct, general, frames read directly): what `realign_both_ways` gives for a
    recording, with each change (frame index, how, a number) first made by `alter(frame,
    how, number, vocabulary size)`. The general read must take no frame directly."""
    vocab = recording_vocab(folder)
    chunks = recording_chunks(folder, rec)
    for at, how, k in changes:
        frame = chunks[at % len(chunks)]
        if isinstance(frame, dict) and alter is not None:
            alter(frame, how, k, vocab.size)
    direct, taken = realign_both_ways(vocab, chunks, segments, True, method)
    general, none = realign_both_ways(vocab, chunks, segments, False, method)
    assert none == 0
    return direct, general, taken
