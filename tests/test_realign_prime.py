"""`Realigner.prime()`: the aligner over a known prompt built before the first chunk.

The proxy's reader calls it once the upstream's answer has begun and its first token is
still being computed (`engines.upstream.wire.StepReader.prime`), so that the setup over
the prompt is not paid on the first token's way out (issue #32, time to first token).
Priming must change nothing a caller sees: on every real llama-server and vLLM recording
in tests/data/realign, read in the context of a prompt, the events, segments and result
of a primed realigner equal an unprimed one's, with segments and without; and a primed
one builds no aligner while it reads. Where the stream itself decides the mode (no
prompt and a vocabulary with first-token rules: SentencePiece), priming builds nothing.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

import tokentrail.realign.feeding as feeding
from tests.helpers.realign_recordings import (
    DATA,
    llama_recordings,
    recording_chunks,
    recording_vocab,
    vllm_recordings,
)
from tokentrail import load_vocab
from tokentrail.realign import Realigner

RECORDINGS = llama_recordings() + vllm_recordings()


def _read(vocab: Any, chunks: list[Any], prompt: list[int], segments: bool, prime: bool,
          built: list[None]) -> tuple[tuple[Any, ...], int, int]:  # fmt: skip
    """Everything a caller sees of one stream, and how many aligners were built by
    `prime` and while reading (`built` grows by one for each)."""
    events: list[Any] = []
    r = Realigner(vocab, prompt_ids=prompt, on_token=events.append, segments=segments)
    start = len(built)
    if prime:
        r.prime()
    primed = len(built)
    fed = [seg for chunk in chunks for seg in r.feed(copy.deepcopy(chunk))]
    fed += r.finish()
    return (events, fed, r.result()), primed - start, len(built) - primed


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """A list that grows by one entry for every aligner the feeder builds."""
    built: list[None] = []
    real = feeding.new_aligner

    def new_aligner(*args: Any, **kwargs: Any) -> Any:
        built.append(None)
        return real(*args, **kwargs)

    monkeypatch.setattr(feeding, "new_aligner", new_aligner)
    return built


@pytest.mark.parametrize(
    ("folder", "rec"), RECORDINGS, ids=[f"{f}/{r['name']}" for f, r in RECORDINGS]
)
@pytest.mark.parametrize("segments", [True, False])
def test_a_primed_realigner_reads_every_recording_as_an_unprimed_one(
    folder: str, rec: dict[str, Any], segments: bool, counted: list[None]
) -> None:
    vocab = recording_vocab(folder)
    chunks = recording_chunks(folder, rec)
    prompt = list(rec.get("prompt_ids") or vocab.encode(rec["prompt"], add_special_tokens=True))
    assert prompt
    plain, _, _ = _read(vocab, chunks, prompt, segments, prime=False, built=counted)
    primed, by_prime, while_reading = _read(vocab, chunks, prompt, segments, prime=True,
                                            built=counted)  # fmt: skip
    assert primed == plain
    assert plain[0], "the recording gave events"
    # One aligner (special tokens' skipping undecided: two), all built by prime().
    assert 1 <= by_prime <= 2 and while_reading == 0


def test_priming_waits_for_the_stream_where_the_stream_decides(
    corpus: Path, counted: list[None]
) -> None:
    """SentencePiece (Llama 2's tokenizer.model) with no prompt: whether the first piece
    keeps its leading space is read from the content, so prime() builds nothing and the
    first chunk decides. With a prompt, the prompt's text comes first and a primed
    realigner reads llama-server's real SentencePiece stream as an unprimed one does."""
    vocab = load_vocab(corpus / "tokenizers" / "llama2" / "tokenizer.model")
    assert vocab.strip_leading or vocab.first_pieces
    r = Realigner(vocab, skip_special_tokens=True)
    r.prime()
    assert counted == []

    name = "llamacpp_completion_stream_spm"
    lines = (DATA / f"{name}.jsonl").read_text("utf-8").splitlines()
    chunks = [json.loads(line) for line in lines if line.strip()]
    prompt = vocab.encode("Write a sentence about spring.", add_special_tokens=True)
    for segments in (True, False):
        plain, _, _ = _read(vocab, chunks, prompt, segments, prime=False, built=counted)
        primed, by_prime, while_reading = _read(vocab, chunks, prompt, segments, prime=True,
                                                built=counted)  # fmt: skip
        assert primed == plain and plain[0]
        assert by_prime == 2 and while_reading == 0  # special tokens: skipped or not
