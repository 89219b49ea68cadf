"""Property tests of the aligner's invariants (DESIGN.md) against each tokenizer's own decode.

Every tokenizer in the corpus is checked on encoded real text in many scripts, random
ids, random ids biased to byte tokens, and random special tokens, with
skip_special_tokens on and off. The oracle is the tokenizer library's own decode.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tokentrail
from tests.helpers.env import corpus_path
from tests.helpers.tokenizer_specs import SAMPLES, SPECS, own_bytes, spec_aligner
from tokentrail import Aligner, Segment, TokenizerLoadError


def _get(key: str, skip: bool) -> Aligner:
    _name, rel, how = next(s for s in SPECS if s[0] == key)
    if how != "demo":
        corpus_path(rel)
    return spec_aligner(key, skip)


def _stream(aligner: Aligner, ids: list[int]) -> tuple[list[Segment], list[str]]:
    """Push ids one by one; return all segments and the emitted text after each push."""
    segments: list[Segment] = []
    emitted: list[str] = []
    text = ""
    for i in ids:
        out = aligner.push(i, logprob=-0.5)
        assert len(out) <= 1, "one push emits at most one segment"
        segments.extend(out)
        text += "".join(s.text for s in out)
        emitted.append(text)
    out = aligner.finish()
    assert len(out) <= 1
    segments.extend(out)
    return segments, emitted


def check_invariants(aligner: Aligner, ids: list[int]) -> None:
    v = aligner.vocab
    skip = aligner.skip_special_tokens
    segments, emitted = _stream(aligner, ids)
    reference = v.decode(ids, skip)
    # 1. exact: the concatenation equals the tokenizer's own decode
    assert "".join(s.text for s in segments) == reference
    # 2. prefix-stable: what was emitted after k tokens is final whatever comes next
    if len(ids) <= 24:
        for k in range(1, len(ids)):
            assert reference.startswith(emitted[k - 1])
            other = ids[:k] + ids[k:][::-1]
            assert v.decode(other, skip).startswith(emitted[k - 1]), (ids[:k], other)
    # 3. every token appears, in order; its bytes are covered exactly once, contiguously
    seen: dict[int, int] = {}
    last = -1
    first = True
    for seg in segments:
        assert seg.tokens, "a segment always lists tokens"
        for t in seg.tokens:
            assert t.index >= last
            last = t.index
            assert t.id == ids[t.index]
            assert t.logprob == -0.5
            assert seg.tokens.count(t) == 1
            assert t.start == seen.get(t.index, 0), "byte ranges continue where they stopped"
            assert t.start <= t.end
            seen[t.index] = t.end
        seg_bytes = b"".join(own_bytes(aligner, ids, t.index)[t.start : t.end] for t in seg.tokens)
        if v.cleanup or v.generic is not None or "\ufffd" in seg.text:
            continue
        decoded = seg_bytes.decode("utf-8")
        if first and v.strip_leading | bool(v.first_pieces):
            assert decoded.endswith(seg.text) and not decoded[: len(decoded) - len(seg.text)].strip(
                " "
            )
        else:
            assert decoded == seg.text, (decoded, seg.text)
        first = first and not seg.text
    assert sorted(seen) == list(range(len(ids)))
    for i in range(len(ids)):
        assert seen[i] == len(own_bytes(aligner, ids, i)), f"token {i} bytes not all attributed"


def _valid_ids(v: tokentrail.Vocab) -> list[int]:
    return [i for i, p in enumerate(v.pieces) if p is not None]


@functools.cache
def _pools(key: str) -> tuple[list[int], list[int], list[int]]:
    """(all ids, byte-ish ids, special ids) of a tokenizer."""
    v = spec_aligner(key, False).vocab
    ids = _valid_ids(v)
    bytey = sorted(v.byte_ids) or [i for i in ids if v.texts[i] is None] or ids
    special = sorted(v.special | v.hidden) or ids[:1]
    return ids, bytey, special


KEYS = [s[0] for s in SPECS]
SETTINGS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("skip", [False, True], ids=["keep-special", "skip-special"])
@pytest.mark.parametrize("key", KEYS)
@SETTINGS
@given(data=st.data())
def test_real_text(key: str, skip: bool, data: st.DataObject) -> None:
    aligner = _get(key, skip)
    text = data.draw(
        st.one_of(
            st.sampled_from(SAMPLES),
            st.lists(st.sampled_from(SAMPLES), min_size=2, max_size=4).map("".join),
            st.text(max_size=40),
        )
    )
    ids = aligner.vocab.encode(text)
    assume(ids)
    _, _, special = _pools(key)
    if data.draw(st.booleans()):  # sprinkle special tokens between real tokens
        for _ in range(data.draw(st.integers(1, 3))):
            ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from(special)))
    check_invariants(aligner, ids)


@pytest.mark.parametrize("skip", [False, True], ids=["keep-special", "skip-special"])
@pytest.mark.parametrize("key", KEYS)
@SETTINGS
@given(data=st.data())
def test_random_ids(key: str, skip: bool, data: st.DataObject) -> None:
    aligner = _get(key, skip)
    every, bytey, special = _pools(key)
    pool = data.draw(st.sampled_from(["uniform", "bytes", "mixed"]))
    if pool == "uniform":
        ids = data.draw(st.lists(st.sampled_from(every), min_size=1, max_size=24))
    elif pool == "bytes":
        ids = data.draw(st.lists(st.sampled_from(bytey), min_size=1, max_size=24))
    else:
        ids = data.draw(
            st.lists(
                st.one_of(st.sampled_from(every), st.sampled_from(bytey), st.sampled_from(special)),
                min_size=1,
                max_size=24,
            )
        )
    check_invariants(aligner, ids)


# -- earliest emission ---------------------------------------------------------------------


@pytest.mark.parametrize("key", ["gpt2-json", "llama3-tiktoken", "llama2-spm", "qwen2-folder"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_holds_back_only_incomplete_characters(key: str, data: st.DataObject) -> None:
    """After each token, the only text not yet emitted is the U+FFFD that an incomplete
    UTF-8 tail decodes to: complete characters go out at once."""
    aligner = _get(key, False)
    v = aligner.vocab
    every, bytey, _ = _pools(key)
    ids = data.draw(
        st.lists(st.one_of(st.sampled_from(every), st.sampled_from(bytey)), min_size=1, max_size=16)
    )
    ids = [i for i in ids if i not in v.special and i not in v.hidden]
    assume(ids)
    _, emitted = _stream(aligner, ids)
    for k in range(1, len(ids) + 1):
        ref = v.decode(ids[:k], False)
        assert ref.startswith(emitted[k - 1])
        rest = ref[len(emitted[k - 1]) :]
        assert set(rest) <= {"\ufffd"} and len(rest) <= 3, (ids[:k], rest)


def test_hf_byte_fallback_holds_whole_run_and_matches_quirk(corpus: Path) -> None:
    """tokenizers turns a whole invalid <0xNN> run into U+FFFD, valid bytes included,
    so '&' cannot be emitted until the run is known to be valid; sentencepiece decodes
    the same ids byte by byte, so there '&' goes out at once."""
    hf = _get("llama2-hf-json", False)
    spm = _get("llama2-spm", False)
    amp, e2 = hf.vocab.encode("&")[0], None
    tok = hf.vocab.source
    amp, e2 = tok.token_to_id("<0x26>"), tok.token_to_id("<0xE2>")
    hello = tok.token_to_id("▁Hello")
    assert hf.push(amp) == []
    assert hf.push(e2) == []
    [seg] = hf.push(hello)
    assert seg.text == "\ufffd\ufffd Hello" == hf.vocab.decode([amp, e2, hello])
    assert [t.index for t in seg.tokens] == [0, 1, 2]
    hf.finish()
    [first] = spm.push(amp)
    assert first.text == "&"
    assert spm.push(e2) == []
    [seg] = spm.push(hello)
    assert "&" + seg.text == spm.vocab.decode([amp, e2, hello]) == "&\ufffd Hello"
    spm.finish()


def test_byte_level_nul_and_leading_space(corpus: Path) -> None:
    """Two mlx-lm failures (FINDINGS 1a/1b): byte 0x00 ('Ā') and a kept leading space."""
    a = _get("gpt2-json", False)
    tok = a.vocab.source
    nul, lead = tok.token_to_id("Ā"), tok.token_to_id("Ġleading")
    segs = a.align([nul, lead])
    assert "".join(s.text for s in segs) == "\x00 leading" == a.vocab.decode([nul, lead])


def test_character_split_between_tokens_attributed_to_both(corpus: Path) -> None:
    """A token holding the end of one character and the start of the next appears in
    two segments, with complementary byte ranges; the complete character goes out at once."""
    a = _get("gpt2-json", False)
    v = a.vocab
    single = {p: i for i, p in enumerate(v.pieces) if p is not None and len(p) == 1}
    # a token that ends one character (one continuation byte) and starts another (a lead byte)
    straddler = next(
        i
        for i, p in enumerate(v.pieces)
        if p
        and len(p) >= 2
        and 0x80 <= p[0] < 0xC0
        and 0xE0 <= p[-1] < 0xF0
        and all(b < 0x80 for b in p[1:-1])
    )
    ids = [single[b"\xc3"], straddler, single[b"\x81"], single[b"\x82"]]
    segs = a.align(ids)
    assert "".join(s.text for s in segs) == v.decode(ids)
    head = (b"\xc3" + v.pieces[straddler][:-1]).decode()
    assert segs[0].text == head, "the complete characters go out with the straddler"
    ranges: dict[int, list[tuple[int, int]]] = {}
    for s in segs:
        for t in s.tokens:
            ranges.setdefault(t.index, []).append((t.start, t.end))
    split = {i: r for i, r in ranges.items() if len(r) > 1}
    assert split, "expected a token whose bytes straddle two characters"
    for i, r in split.items():
        assert r[0][0] == 0 and r[-1][1] == len(a.vocab.pieces[ids[i]])
        assert all(r[k][1] == r[k + 1][0] for k in range(len(r) - 1))


def test_skipped_special_token_is_listed_with_zero_bytes(corpus: Path) -> None:
    a = _get("gpt2-json", True)
    eos = a.vocab.source.token_to_id("<|endoftext|>")
    hello = a.vocab.encode("Hello")
    segs = [s for i in [*hello, eos] for s in a.push(i, logprob=-1.0)] + a.finish()
    last = segs[-1]
    assert last.text == "" and [(t.id, t.start, t.end) for t in last.tokens] == [(eos, 0, 0)]
    assert "".join(s.text for s in segs) == a.vocab.decode([*hello, eos], True) == "Hello"


def test_spm_dummy_prefix_stripped_after_control_token(corpus: Path) -> None:
    a = _get("llama2-spm", False)
    sp = a.vocab.source
    ids = [1, *sp.encode("Hello world")]
    segs = a.align(ids)
    assert "".join(s.text for s in segs) == sp.decode(ids) == "Hello world"
    assert segs[0].tokens[0].id == 1 and segs[0].tokens[0].start == segs[0].tokens[0].end == 0


def test_cleanup_holds_space_until_known(corpus: Path) -> None:
    a = _get("qwen2-transformers-clean", False)
    ids = a.vocab.encode("Hello , world n't")
    segs, emitted = _stream(a, ids)
    assert "".join(s.text for s in segs) == "Hello, worldn't" == a.vocab.decode(ids, False)
    assert not any(e.endswith(" ") for e in emitted), "a space that clean-up may remove is held"


def test_aligner_never_calls_the_tokenizer_while_streaming(corpus: Path) -> None:
    a = Aligner(corpus_path("tokenizers/llama2/tokenizer.model"))
    ids = a.vocab.encode(SAMPLES[2] + SAMPLES[6])
    a.vocab.source = None
    a.vocab.oracle = None
    assert "".join(s.text for s in a.align(ids))


def test_generic_path_for_unknown_decoder_is_exact() -> None:
    """A decoder pipeline with a regex Replace has no per-token form: the generic path."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "_": 3, "ab": 4, "__": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace(Regex("_+"), " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    a = Aligner(tok)
    assert a.vocab.generic is not None
    for ids in ([1, 3, 3, 2], [3, 1, 5, 3, 4], [5, 5, 1]):
        assert "".join(s.text for s in a.align(ids)) == tok.decode(ids)


def test_top_logprobs_carry_bytes_and_text(corpus: Path) -> None:
    a = _get("gpt2-json", False)
    tok = a.vocab.source
    hi, nul = tok.token_to_id("Hi"), tok.token_to_id("Ā")
    [seg] = a.push(hi, logprob=-0.1, top_logprobs={hi: -0.1, nul: -3.0})
    alts = seg.tokens[0].top_logprobs
    assert [(x.id, x.bytes, x.text) for x in alts] == [(hi, b"Hi", "Hi"), (nul, b"\x00", "\x00")]
    assert seg.confidence is not None and seg.confidence.min_logprob == -0.1
    a.finish()


# -- bad input -------------------------------------------------------------------------------


def test_bad_ids_raise_clear_errors(corpus: Path) -> None:
    a = _get("gpt2-json", False)
    with pytest.raises(ValueError, match="token id 99999999 is outside the vocabulary"):
        a.push(99999999)
    with pytest.raises(ValueError, match="token id -1"):
        a.push(-1)
    with pytest.raises(TypeError, match="token id must be an int"):
        a.push("seven")  # type: ignore[arg-type]


def test_bad_tokenizer_paths(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="does not exist"):
        Aligner(tmp_path / "nope.json")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(TokenizerLoadError, match="not a recognised tokenizer file"):
        Aligner(junk)
    with pytest.raises(TokenizerLoadError, match="no tokenizer"):
        Aligner(tmp_path)
    with pytest.raises(TokenizerLoadError, match="unsupported tokenizer object"):
        Aligner(object())
