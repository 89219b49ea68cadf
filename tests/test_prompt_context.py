"""Prompt as read-only context: the continuation's text is what decode(prompt + ids) adds."""

from __future__ import annotations

import copy

import pytest

import tokentrail
from tokentrail.generate import DEMO_MODEL

TOKENIZER = DEMO_MODEL / "tokenizer.json"


@pytest.fixture(scope="module")
def hf():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER))


def test_split_character_across_prompt_boundary(hf) -> None:
    ids = hf.encode("水は房").ids
    assert len(ids) > 3
    for cut in range(1, len(ids)):
        aligner = tokentrail.Aligner(TOKENIZER, prompt_ids=ids[:cut])
        segs = [s for i in ids[cut:] for s in aligner.push(i)]
        prompt_text = aligner.prompt_text
        segs += aligner.finish()
        assert prompt_text + "".join(s.text for s in segs) == hf.decode(ids)
        cont = [t.index for s in segs for t in s.tokens if t.index >= 0]
        assert sorted(set(cont)) == list(range(len(ids) - cut))
        # prompt tokens that appear are the prompt's still-open tail, counted back from -1
        prompt_idx = {t.index for s in segs for t in s.tokens if t.index < 0}
        assert all(-cut <= i < 0 for i in prompt_idx)


def test_reset_and_fresh_keep_or_replace_the_prompt(hf) -> None:
    ids = hf.encode("Hello world, again").ids
    aligner = tokentrail.Aligner(TOKENIZER, prompt_ids=ids[:2])
    first = aligner.prompt_text
    aligner.finish()
    assert aligner.prompt_text == first and aligner.prompt_ids == tuple(ids[:2])
    other = aligner.fresh(prompt_ids=None)
    assert other.prompt_ids == () and other.prompt_text == ""
    assert aligner.prompt_ids == tuple(ids[:2])


def test_bad_prompt_ids_name_the_argument() -> None:
    with pytest.raises(ValueError, match="prompt_ids"):
        tokentrail.Aligner(TOKENIZER, prompt_ids=[1, 10**9])
    with pytest.raises(TypeError, match="prompt_ids"):
        tokentrail.Aligner(TOKENIZER, prompt_ids="abc")


def test_shallow_copy_mid_stream_shares_no_state(hf) -> None:
    ids = hf.encode("東京").ids
    aligner = tokentrail.Aligner(TOKENIZER)
    head = "".join(s.text for i in ids[:-1] for s in aligner.push(i))
    twin = copy.copy(aligner)
    a = [s.text for i in ids[-1:] for s in aligner.push(i)] + [s.text for s in aligner.finish()]
    b = [s.text for s in twin.finish()]
    assert head + "".join(a) == hf.decode(ids)
    assert head + "".join(b) == hf.decode(ids[:-1])
