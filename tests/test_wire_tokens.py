"""One token on the wire (`tokentrail.server.wire_tokens`), and one token's confidence.

`Spellings` works each vocabulary's per-id spelling out once (the id check, the decode,
the byte list) where every chunk used to redo it for its token and every alternative,
twice. It must spell exactly as the vocabulary does: held here against `Vocab` itself
on real tokenizers of several families (byte-level BPE, sentencepiece with byte
fallback and control pieces, a Unigram model), every id, plus ids outside them.
`confidence_of` takes a shortcut for a one-token segment (most of them); it must give
the very figures of the general path.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.env import REPO, corpus_path
from tokentrail import load_vocab
from tokentrail.segment import Alternative, TokenSpan, confidence_of
from tokentrail.server.wire_tokens import Spellings, spellings, wire_logprob

DEMO = REPO / "src" / "tokentrail" / "demo_model"


def _folder(name: str) -> Path:
    return DEMO if name == "demo" else corpus_path("tokenizers", name)


@pytest.mark.parametrize("name", ["demo", "llama2", "t5", "qwen2"])
def test_spellings_are_the_vocabularys_own(name: str) -> None:
    vocab = load_vocab(str(_folder(name)))
    spell = Spellings(vocab)
    step = 1 if vocab.size < 60_000 else 7  # qwen2's 151k ids: every 7th
    for i in range(0, vocab.size, step):
        if not vocab.has_id(i):  # an id the model has, the tokenizer not
            assert spell.token_text(i) == "" and spell.token_bytes(i) == []
            continue
        assert spell.token_text(i) == vocab.token_text(i), i
        assert spell.token_bytes(i) == list(vocab.token_bytes(i)), i
        assert spell.token_text(i) == vocab.token_text(i), i  # from the table now
    for bad in (-1, vocab.size, vocab.size + 17):
        assert spell.token_text(bad) == "" and spell.token_bytes(bad) == []
        assert spell.completion_token(bad) == ""
    assert spell.skip == vocab.special | vocab.hidden
    assert spellings(vocab) is spellings(vocab)  # one table per vocabulary


def _unspelled(name: str) -> bytes:
    """The bytes an OpenAI completions token string stands for: ``bytes:\\xNN...`` read
    back, else the text's own UTF-8."""
    if name.startswith("bytes:"):
        return bytes(int(h, 16) for h in name[len("bytes:"):].split("\\x")[1:])
    return name.encode("utf-8")


@pytest.mark.parametrize("name", ["demo", "llama2", "t5", "qwen2"])
def test_completion_token_strings_keep_every_byte(name: str) -> None:
    """A completions-API token string is the token's text where its bytes are UTF-8 on
    their own, else OpenAI's ``bytes:\\xNN`` form, which reads back to the very bytes
    (a byte-fallback piece, half a character); a token without bytes shows its text."""
    vocab = load_vocab(str(_folder(name)))
    spell = Spellings(vocab)
    step = 1 if vocab.size < 60_000 else 7
    forms = 0
    for i in range(0, vocab.size, step):
        if not vocab.has_id(i):
            assert spell.completion_token(i) == ""
            continue
        raw, got = vocab.token_bytes(i), spell.completion_token(i)
        if not raw:
            assert got == vocab.token_text(i), i
            continue
        assert _unspelled(got) == raw, (i, got, raw)
        try:
            assert got == raw.decode("utf-8"), i
        except UnicodeDecodeError:
            assert got.startswith("bytes:"), (i, got)
            forms += 1
        assert spell.completion_token(i) is got  # made once
    if name in ("llama2", "qwen2"):  # byte-fallback pieces / byte-level halves exist
        assert forms > 0


def test_a_shared_byte_list_is_equal_to_a_fresh_one() -> None:
    vocab = load_vocab(str(DEMO))
    spell = spellings(vocab)
    ids = [i for i in range(vocab.size) if vocab.has_id(i)][:50]
    first = [spell.token_bytes(i) for i in ids]
    again = [spell.token_bytes(i) for i in ids]
    assert all(a is b for a, b in zip(first, again, strict=True))  # made once
    assert again == [list(vocab.token_bytes(i)) for i in ids]


def test_chat_logprob_spells_a_skipped_alternative_as_empty() -> None:
    vocab = load_vocab(str(DEMO))
    special = min(vocab.special)
    plain = next(i for i in range(vocab.size) if vocab.has_id(i) and i not in vocab.special)
    raw = vocab.token_bytes(plain)
    named = vocab.token_text(special)
    alts = (Alternative(plain, -0.1, raw, vocab.token_text(plain)),
            Alternative(special, -2.5, vocab.token_bytes(special), named))  # fmt: skip
    span = TokenSpan(0, plain, 0, len(raw), -0.1, alts, False)
    out = spellings(vocab).chat_logprob(span, 5)
    assert out["token"] == vocab.token_text(plain) and out["bytes"] == list(raw)
    assert out["top_logprobs"][0] == {"token": vocab.token_text(plain), "logprob": -0.1,
                                      "bytes": list(raw)}  # fmt: skip
    assert out["top_logprobs"][1] == {"token": "", "logprob": -2.5, "bytes": []}
    assert len(spellings(vocab).chat_logprob(span, 1)["top_logprobs"]) == 1


@given(st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)))
def test_wire_logprob_is_the_one_rule(x: float | None) -> None:
    got = wire_logprob(x)
    if x is None or math.isfinite(x):
        assert got == x
    elif x != x or x > 0:  # NaN, +inf: null
        assert got is None
    else:
        assert got == -9999.0


_lp = st.floats(min_value=-800.0, max_value=0.0, allow_nan=False)
_alts = st.lists(_lp, min_size=0, max_size=6)


@settings(max_examples=300)
@given(st.one_of(st.none(), _lp), _alts)
def test_one_token_confidence_is_the_general_paths(lp: float | None, top: list[float]) -> None:
    alts = tuple(Alternative(k, v, b"x", "x") for k, v in enumerate(top)) or None
    span = TokenSpan(0, 1, 0, 1, lp, alts, False)
    # A second token with no logprob and no alternatives adds nothing to any figure but
    # takes the general path (lists, sums): the figures must be the very same.
    bare = TokenSpan(1, 1, 0, 1, None, None, False)
    one, general = confidence_of((span,)), confidence_of((span, bare))
    assert one == general
    if lp is not None:
        assert one is not None
        assert one.mean_logprob == lp and one.n_tokens == 1
        assert one.probability == pytest.approx(math.exp(lp), rel=1e-12, abs=1e-300)
        if alts:
            ps = [math.exp(v) for v in top]
            z = sum(ps)
            if z > 0:
                h = -sum(p / z * math.log(p / z) for p in ps if p > 0)
                assert one.entropy == pytest.approx(max(0.0, h), abs=1e-9)
