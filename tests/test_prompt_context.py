"""Prompt as read-only context: the continuation's text is what decode(prompt + ids) adds."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


# -- ChatGLM3: byte fallback, then Metaspace, with no Fuse -------------------------------------
#
# tokenizers' ByteFallback hands the next step one string per run of byte tokens (its text
# when the whole run is valid UTF-8, else one U+FFFD per byte), and with no Fuse the
# Metaspace after it works on each string: "▁" becomes a space, and every "▁" of the first
# string is dropped. So a valid run that spells "▁" turns into a space (or nothing, first),
# and a prompt cut inside a run is decided only with the continuation's bytes.

GLM_BYTES = st.sampled_from(
    [0xE2, 0x96, 0x81, 0xD9, 0xA1, 0xF0, 0x9F, 0x99, 0x82, 0x26, 0x20, 0x41, 0xFF, 0xC3]
) | st.integers(0, 255)
GLM_CHARS = st.sampled_from(list("▁▁١٢🙂👍🏽ḁ")) | st.characters(
    codec="utf-8", exclude_categories=("Cs",)
)
GLM_TEXT = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",))
    | st.sampled_from(list("▁ ١٢٣٤٥مرحبا🙂👍🏽🇫🇷你好 \n")),
    max_size=12,
)


class _Glm:
    """ChatGLM3's tokenizer (the oracle) and an aligner per skip_special_tokens; with
    `decoder`, the same file under another decoder whose steps follow an unfused
    ByteFallback (the rule comes from the pipeline, not from the file)."""

    def __init__(self, path: Any, decoder: str) -> None:
        from tokenizers import Tokenizer, decoders

        self.name = decoder
        self.hf = Tokenizer.from_file(str(path))
        if decoder == "replace":
            self.hf.decoder = decoders.Sequence(
                [decoders.ByteFallback(), decoders.Replace("▁", " ")]
            )
        elif decoder == "metaspace-never":
            self.hf.decoder = decoders.Sequence(
                [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="never")]
            )
        src = path if decoder == "file" else self.hf
        self.aligners = {s: tokentrail.Aligner(src, skip_special_tokens=s) for s in (False, True)}

    def __repr__(self) -> str:  # hypothesis prints the fixture of a failing case
        return f"<chatglm3 {self.name}>"


@pytest.fixture(scope="module", params=["file", "replace", "metaspace-never"])
def glm(request: pytest.FixtureRequest) -> _Glm:
    from tests.helpers.env import corpus_path

    return _Glm(corpus_path("tokenizers/chatglm3/tokenizer.json"), request.param)


@st.composite
def glm_ids(draw: st.DrawFn, hf: Any) -> list[int]:
    """Ids as a model might sample them: encoded text in many scripts, byte tokens
    (parts of "▁", Arabic-Indic digits, emoji, invalid bytes), specials, any id."""
    out: list[int] = []
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["text", "char", "char", "byte", "special", "any"]))
        if kind == "char":  # a character spelled in byte tokens, maybe cut short
            raw = draw(GLM_CHARS).encode("utf-8")
            raw = raw[: draw(st.integers(1, len(raw)))]
            out += [hf.token_to_id(f"<0x{b:02X}>") for b in raw]
        elif kind == "text":
            out += hf.encode(draw(GLM_TEXT), add_special_tokens=False).ids
        elif kind == "byte":
            out.append(hf.token_to_id(f"<0x{draw(GLM_BYTES):02X}>"))
        elif kind == "special":
            out.append(draw(st.sampled_from([0, 1, 2, 64789, 64790, 64792])))
        else:
            out.append(draw(st.integers(0, hf.get_vocab_size() - 1)))
    return out


@given(data=st.data())
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_chatglm3_prompt_context_decodes_as_tokenizers(glm: _Glm, data: st.DataObject) -> None:
    """prompt_text + continuation == tokenizers' decode of prompt + continuation, for any
    split of any ids; the prompt's text is what it alone made final; every continuation
    token starts exactly once."""
    hf, aligners = glm.hf, glm.aligners
    ids = data.draw(glm_ids(hf))
    cut = data.draw(st.integers(0, len(ids)))
    skip = data.draw(st.booleans())
    a = aligners[skip].fresh(prompt_ids=ids[:cut])
    segs = [s for i in ids[cut:] for s in a.push(i, -0.5)]
    prompt_text = a.prompt_text
    segs += a.finish()
    assert prompt_text + "".join(s.text for s in segs) == hf.decode(ids, skip_special_tokens=skip)
    # The prompt alone: what a plain aligner made final for it before its end.
    plain = aligners[skip].fresh(prompt_ids=None)
    assert prompt_text == "".join(s.text for i in ids[:cut] for s in plain.push(i))
    starts = [t.index for s in segs for t in s.tokens if t.index >= 0 and t.start == 0]
    assert sorted(set(starts)) == list(range(len(ids) - cut))
    assert all(-cut <= t.index for s in segs for t in s.tokens)


@pytest.mark.parametrize("cut", range(6))
def test_chatglm3_byte_run_spelling_the_metaspace_mark(glm: _Glm, cut: int) -> None:
    """A valid run spelling "▁" (E2 96 81) is one string to the steps after ByteFallback:
    a space mid-text, nothing at the start of the decode; an invalid run is U+FFFD per
    byte wherever the prompt ends."""
    hf = glm.hf
    b = [hf.token_to_id(f"<0x{x:02X}>") for x in (0xE2, 0x96, 0x81, 0xD9)]
    a_id = hf.token_to_id("a")
    for ids in ([*b[:3], a_id, *b[:3], a_id], [a_id, *b[:3], *b[:3]], [b[3], *b[:3], a_id, b[0]]):
        want = hf.decode(ids, skip_special_tokens=True)
        al = glm.aligners[True].fresh(prompt_ids=ids[:cut])
        got = al.prompt_text + "".join(s.text for i in ids[cut:] for s in al.push(i))
        assert got + "".join(s.text for s in al.finish()) == want
