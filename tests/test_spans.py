"""Spans cover exactly the bytes of their text, where a decode rule strips a leading space.

A Llama-2-style tokenizer.json (Replace, ByteFallback, Fuse, then `Strip` of one leading
space) drops the space of the text's first word. The first token `▁h` gives the text
`'h'`, and its span must then cover one byte, as the same token does through the
sentencepiece model (whose dummy-prefix rule drops the same space): a segment's spans
applied to each token's bytes as emitted join to its text.

The files are the Llama 2 and Mistral sentencepiece models of the corpus converted by
transformers into tokenizer.json. The oracle is `tokenizers`' own decode: a token's
share of the text is what its decode adds to the decode of the tokens before it, and
sentencepiece's spans for the same ids are the second witness.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.env import require
from tokentrail import Aligner, Segment

MODELS = {
    "llama2": "tokenizers/llama2/tokenizer.model",
    "mistral-v1": "tokenizers/mistral/tokenizer.model.v1",
    "mistral-v3": "tokenizers/mistral/mistral_instruct_tokenizer_240323.model.v3",
}
WORDS = ["h", "hello", "world", " ", "  two", "café", "你好", "🙂", "\n", "x1", "Ångström", "."]
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
_CACHE: dict[str, tuple[Aligner, Aligner, Aligner, Aligner]] = {}


def _aligners(corpus: Path, key: str, tmp: Path) -> tuple[Aligner, Aligner, Aligner, Aligner]:
    """(tokenizer.json keep, skip, sentencepiece keep, skip) for one model."""
    if key not in _CACHE:
        transformers = require("transformers")
        model = corpus / MODELS[key]
        if not model.is_file():
            pytest.skip(f"{model} missing from the corpus")
        src, out = tmp / f"{key}-src", tmp / f"{key}-hf"
        src.mkdir()
        (src / "tokenizer.model").symlink_to(model)
        transformers.AutoTokenizer.from_pretrained(src).save_pretrained(out)
        hf = str(out / "tokenizer.json")
        _CACHE[key] = (
            Aligner(hf),
            Aligner(hf, skip_special_tokens=True),
            Aligner(str(model)),
            Aligner(str(model), skip_special_tokens=True),
        )
    return _CACHE[key]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spans")


def _stream(a: Aligner, ids: list[int]) -> list[Segment]:
    out: list[Segment] = []
    for i in ids:
        out.extend(a.push(i))
    out.extend(a.finish())
    return out


def _per_token(segments: list[Segment]) -> dict[int, int]:
    """Bytes attributed to each token index, over all its spans."""
    total: dict[int, int] = {}
    for s in segments:
        for t in s.tokens:
            total[t.index] = total.get(t.index, 0) + t.end - t.start
    return total


def _check(a: Aligner, ids: list[int], prompt: list[int]) -> list[Segment]:
    v, skip = a.vocab, a.skip_special_tokens
    ctx = a.fresh(prompt) if prompt else a.fresh(None)
    segments = _stream(ctx, ids)
    full = v.decode(prompt + ids, skip)
    assert ctx.prompt_text + "".join(s.text for s in segments) == full
    for s in segments:
        if "\ufffd" not in s.text:
            assert sum(t.end - t.start for t in s.tokens) == len(s.text.encode()), s
    # Each token's bytes are what its decode adds to the text before it.
    shares = _per_token(segments)
    before = v.decode(prompt, skip)
    for k, tid in enumerate(ids):
        after = v.decode(prompt + ids[: k + 1], skip)
        if "\ufffd" not in after and after.startswith(before):
            assert shares.get(k, 0) == len(after.encode()) - len(before.encode()), (k, tid)
        before = after
    return segments


@pytest.mark.corpus
@pytest.mark.parametrize("key", list(MODELS))
@SETTINGS
@given(
    words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=5),
    specials=st.lists(st.tuples(st.integers(0, 8), st.sampled_from([0, 1, 2])), max_size=2),
    skip=st.booleans(),
    cut=st.integers(0, 8),
)
def test_spans_cover_exactly_the_text(
    corpus: Path,
    workdir: Path,
    key: str,
    words: list[str],
    specials: list[tuple[int, int]],
    skip: bool,
    cut: int,
) -> None:
    hf_keep, hf_skip, sp_keep, sp_skip = _aligners(corpus, key, workdir)
    hf = hf_skip if skip else hf_keep
    ids = hf.vocab.encode("".join(words))
    for at, special in specials:
        ids.insert(min(at, len(ids)), special)
    # first tokens (no prompt), and continuations of a prompt cut from the same ids
    _check(hf, ids, [])
    cut = min(cut, len(ids))
    _check(hf, ids[cut:], ids[:cut])
    if not specials:
        # The sentencepiece model gives every token the same share of the same text.
        sp = sp_skip if skip else sp_keep
        assert sp.vocab.decode(ids, skip) == hf.vocab.decode(ids, skip)
        assert _per_token(_stream(sp.fresh(None), ids)) == _per_token(_stream(hf.fresh(None), ids))


@pytest.mark.corpus
def test_first_token_of_the_issue(corpus: Path, workdir: Path) -> None:
    """`▁h` first: text 'h', span (0, 1), through tokenizer.json as through tokenizer.model."""
    hf_keep, hf_skip, sp_keep, _ = _aligners(corpus, "llama2", workdir)
    ids = hf_keep.vocab.encode("h hello")
    assert hf_keep.vocab.source.id_to_token(ids[0]) == "▁h"
    for a in (hf_keep, sp_keep):
        first = a.fresh(None).align(ids)[0]
        assert (first.text, [(t.start, t.end) for t in first.tokens]) == ("h", [(0, 1)])
    # after a skipped BOS the word still starts the text; after a kept one it does not
    seg = hf_skip.fresh(None).align([1, *ids])
    assert [(s.text, [(t.start, t.end) for t in s.tokens]) for s in seg][:2] == [
        ("", [(0, 0)]),
        ("h", [(0, 1)]),
    ]
    seg = hf_keep.fresh(None).align([1, *ids])
    assert [(s.text, [(t.start, t.end) for t in s.tokens]) for s in seg][:2] == [
        ("<s>", [(0, 3)]),
        (" h", [(0, 2)]),
    ]
