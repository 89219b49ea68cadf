"""Alternatives that are partial UTF-8 bytes show what choosing them would have shown.

`Alternative.display` is, with the incomplete bytes held before the step, the text the
alternative would have added: the character it completes, else its bytes as `<0xNN>`,
never U+FFFD. The oracle is the tokenizer's own decode of the ids so far plus the
alternative: where that adds no U+FFFD, `display` is exactly what it adds.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokentrail import Aligner
from tokentrail.segment import Alternative

# Byte streams (byte-level BPE, tiktoken) and sentencepiece's byte pieces, where held bytes
# are only an incomplete character's start.
FILES = {
    "gpt2-json": "tokenizers/gpt2/tokenizer.json",
    "gpt2-tiktoken": "tokenizers/gpt2/gpt2.tiktoken",
    "llama3-tiktoken": "tokenizers/llama3/tokenizer.model",
    "llama2-spm": "tokenizers/llama2/tokenizer.model",
}
TEXTS = ["é café", "音乐 パン", "🙂👍🏽", "naïve Ångström", "你好世界", "x"]


@functools.cache
def _aligner(path: str) -> Aligner:
    return Aligner(path)


def _get(corpus: Path, key: str) -> Aligner:
    path = corpus / FILES[key]
    if not path.is_file():
        pytest.skip(f"{path} missing from the corpus")
    return _aligner(str(path)).fresh(None)


def _hex(b: bytes) -> str:
    return "".join(f"<0x{x:02X}>" for x in b)


@functools.cache
def _partial_ids(path: str) -> list[int]:
    """Ids whose bytes are not UTF-8 on their own (byte tokens, partial characters)."""
    v = _aligner(path).vocab
    return sorted(v.byte_ids) or [i for i, t in enumerate(v.texts) if t is None and v.pieces[i]]


@pytest.mark.corpus
@pytest.mark.parametrize("key", list(FILES))
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_display_is_what_the_alternative_adds(corpus: Path, key: str, data: st.DataObject) -> None:
    a = _get(corpus, key)
    v = a.vocab
    ids = v.encode(data.draw(st.sampled_from(TEXTS)))
    k = data.draw(st.integers(0, len(ids)))
    partial = _partial_ids(str(corpus / FILES[key]))
    alts = [*ids[k : k + 1], *data.draw(st.lists(st.sampled_from(partial), max_size=4))]
    alts += data.draw(st.lists(st.integers(0, v.size - 1), max_size=2))
    alts = [i for i in dict.fromkeys(alts) if v.pieces[i] is not None]
    emitted = "".join(s.text for i in ids[:k] for s in a.push(i))
    assert v.decode(ids[:k]).startswith(emitted)
    for alt in a.alternatives([(i, -1.0) for i in alts]):
        assert "\ufffd" not in alt.display or "\ufffd".encode() in alt.bytes
        assert alt.text == v.token_text(alt.id)  # unchanged
        if alt.id in v.hidden or (k == 0 and alt.id in v.first_pieces):
            continue  # shown by name / its mid-text form, not what decode adds
        added = v.decode([*ids[:k], alt.id])[len(emitted) :]
        if "\ufffd" not in added:
            assert alt.display == added, (ids[:k], alt)
    if k == 0:  # nothing held: a partial byte shows as itself
        for alt in a.alternatives([(i, -1.0) for i in partial[:8]]):
            assert alt.display == _hex(alt.bytes) or alt.display == alt.bytes.decode()


@pytest.mark.corpus
def test_the_completed_character_and_the_byte(corpus: Path) -> None:
    """`é` as two byte-level tokens: after `C3`, the alternative `A9` shows `é`; `C3`
    alone shows `<0xC3>`; in the CLI table, the character with its raw byte beside."""
    from tokentrail.generate_cli import alt_label

    a = _get(corpus, "gpt2-json")
    v = a.vocab
    c3, a9 = v.source.token_to_id("Ã"), v.source.token_to_id("©")
    assert (v.token_bytes(c3), v.token_bytes(a9)) == (b"\xc3", b"\xa9")
    (first,) = a.alternatives([(c3, -0.5)])
    assert (first.text, first.display) == ("\ufffd", "<0xC3>")
    assert a.push(c3) == []
    alt, other = a.alternatives([(a9, -0.2), (c3, -1.0)])
    assert (alt.text, alt.display) == ("\ufffd", "é") and v.decode([c3, a9]) == "é"
    assert other.display == "<0xC3>"  # C3 C3 completes nothing
    assert alt.to_dict()["display"] == "é" and alt.to_dict()["text"] == "\ufffd"
    assert alt_label(alt) == "'é' <0xA9>"
    assert alt_label(other) == "'<0xC3>'"


@pytest.mark.corpus
def test_byte_pieces_in_a_fallback_run(corpus: Path) -> None:
    """Sentencepiece byte pieces: `<0xC3>` held, `<0xA9>` completes `é`; a piece that is
    not a byte ends the run and shows as itself."""
    a = _get(corpus, "llama2-spm")
    v = a.vocab
    c3, a9 = v.source.piece_to_id("<0xC3>"), v.source.piece_to_id("<0xA9>")
    the = v.source.piece_to_id("▁The")
    a.push(c3)
    alt, word = a.alternatives([(a9, -0.1), (the, -2.0)])
    assert alt.display == "é" == v.decode([c3, a9])
    assert word.display == " The"


def test_alternative_keeps_its_constructor() -> None:
    """Code that builds an Alternative with four fields still works; to_dict falls back."""
    alt = Alternative(5, -0.5, b"ab", "ab")
    assert alt.display == "" and alt.to_dict()["display"] == "ab"
