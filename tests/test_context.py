"""The continuation invariant: a prompt as read-only context, for every tokenizer.

For an aligner built with `prompt_ids`, `aligner.prompt_text` is the text the prompt alone
made final, and what push/finish return is exactly the rest:

    prompt_text + "".join(continuation texts) == decode(prompt_ids + ids)

Every continuation token appears in order, exactly once as a start (its first span
starts at byte 0 of its own bytes), indices counting from 0; prompt tokens appear only
with negative indices (-1 is the prompt's last token), only the ones carrying the
prompt's still-open tail. `prompt_text` equals what a plain aligner emits for the prompt
before `finish`.

Cuts are drawn at random token boundaries of real multilingual text, inside characters
(byte-level tokens, byte-fallback runs), right after BOS and with special tokens in the
prompt, with skip_special_tokens on and off. The oracle is each library's own decode
(`Vocab.decode`); for GGUF files the llama.cpp reference, itself checked against llama.cpp
in test_gguf_llamacpp.py.

The `test_vllm_*` cases are ported from vLLM's tests/tokenization/test_detokenize.py
(vllm-project/vllm; texts and split rules of `test_decode_streaming` with_prompt,
`test_incomplete_utf8_prompt_no_leak`, `test_thai_edge_case`, `test_oov_decode`), on the
corpus tokenizers closest to vLLM's list (GPT-2, Llama 3, Llama 2/CodeLlama SPM,
GPT-NeoX/Pythia, Falcon, Tekken/Pixtral).
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.env import CORPUS, corpus_path, require
from tests.helpers.tokenizer_specs import (
    SAMPLES,
    SPECS,
    own_bytes,
    spec_aligner,
)
from tokentrail import Aligner, Segment

GGUF = [
    ("gguf-llama-spm", "tokenizers/llama2/ggml-vocab-llama-spm.gguf"),
    ("gguf-deepseek-coder", "tokenizers/deepseek/ggml-vocab-deepseek-coder.gguf"),
    ("gguf-falcon", "tokenizers/falcon/ggml-vocab-falcon.gguf"),
    ("gguf-bert-bge", "tokenizers/bert/ggml-vocab-bert-bge.gguf"),
    ("gguf-baichuan", "tokenizers/baichuan/ggml-vocab-baichuan.gguf"),
    ("llama2c-bin", "tokenizers/llama2/tokenizer.bin"),
]
KEYS = [k for k, _, _ in SPECS] + [k for k, _ in GGUF] + ["tekken"]


def _tekken() -> str:
    require("mistral_common")
    from pathlib import Path

    import mistral_common

    path = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
    if not path.is_file():
        pytest.skip("tekken_240911.json is not shipped with this mistral-common version")
    return str(path)


@functools.cache
def _aligner(key: str, skip: bool) -> Aligner:
    gguf = dict(GGUF)
    if key in gguf:
        return Aligner(str(CORPUS / gguf[key]), skip_special_tokens=skip)
    if key == "tekken":
        return Aligner(_tekken(), skip_special_tokens=skip)
    return spec_aligner(key, skip)


def get(key: str, skip: bool) -> Aligner:
    gguf = dict(GGUF)
    if key in gguf:
        corpus_path(gguf[key])
    elif key != "tekken":
        _name, rel, how = next(s for s in SPECS if s[0] == key)
        if how != "demo":
            corpus_path(rel)
    try:
        return _aligner(key, skip)
    except ImportError as e:
        pytest.skip(f"{key}: {e}")


def encode(a: Aligner, text: str) -> list[int]:
    v = a.vocab
    if type(v.source).__name__ == "Tekkenizer":
        return v.source.encode(text, bos=False, eos=False)
    return v.encode(text)


@functools.cache
def pools(key: str) -> tuple[list[int], list[int], list[int]]:
    """(every id, byte-ish ids, special ids)."""
    v = _aligner(key, False).vocab
    every = [i for i, p in enumerate(v.pieces) if p is not None]
    bytey = sorted(v.byte_ids) or [i for i in every if v.texts[i] is None] or every
    special = sorted(v.special | v.hidden) or every[:1]
    return every, bytey, special


def stable_prompt_text(a: Aligner, prompt: list[int]) -> str:
    """What a plain aligner makes final for the prompt alone, before finish."""
    plain = a.fresh(prompt_ids=None)
    text = "".join(s.text for i in prompt for s in plain.push(i))
    plain.reset()
    return text


def check_continuation(a: Aligner, prompt: list[int], ids: list[int]) -> list[Segment]:
    """Assert the continuation invariant for `ids` after `prompt`; return the segments."""
    c = a.fresh(prompt_ids=prompt)
    assert c.prompt_ids == tuple(prompt)
    segs: list[Segment] = []
    for i in ids:
        out = c.push(i, logprob=-0.25)
        assert len(out) <= 1
        segs += out
    prompt_text = c.prompt_text
    segs += c.finish()
    assert c.prompt_text == prompt_text, "finish keeps the prompt (reset to the same one)"
    skip = a.skip_special_tokens
    assert prompt_text + "".join(s.text for s in segs) == a.vocab.decode(prompt + ids, skip)
    assert prompt_text == stable_prompt_text(a, prompt)
    starts: list[int] = []
    last = -len(prompt) - 1
    ends: dict[int, int] = {}
    for s in segs:
        assert s.tokens, "a segment always lists tokens"
        for t in s.tokens:
            assert t.index >= last, "tokens appear in order"
            last = t.index
            if t.index < 0:
                assert -len(prompt) <= t.index and t.id == prompt[t.index]
                assert t.logprob is None
            else:
                assert t.id == ids[t.index] and t.logprob == -0.25
            if t.index >= 0 or t.index in ends:
                assert t.start == ends.get(t.index, 0), "byte ranges continue where they stop"
            ends[t.index] = t.end
            if t.start == 0 and t.index >= 0 and t.index not in starts:
                starts.append(t.index)
    assert starts == list(range(len(ids))), "every continuation token starts exactly once"
    for index, end in ends.items():  # finish attributes every byte
        assert end == len(own_bytes(a, prompt + ids, len(prompt) + index))
    return segs


SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SKIP = pytest.mark.parametrize("skip", [False, True], ids=["keep-special", "skip-special"])


@SKIP
@pytest.mark.parametrize("key", KEYS)
@SETTINGS
@given(data=st.data())
def test_cut_real_text_at_a_random_boundary(key: str, skip: bool, data: st.DataObject) -> None:
    a = get(key, skip)
    text = data.draw(
        st.one_of(
            st.sampled_from(SAMPLES),
            st.lists(st.sampled_from(SAMPLES), min_size=2, max_size=3).map("".join),
            st.text(max_size=30),
        )
    )
    ids = encode(a, text)
    _, _, special = pools(key)
    if data.draw(st.booleans()):  # a BOS-like special token first
        ids = [data.draw(st.sampled_from(special)), *ids]
    cut = data.draw(st.integers(0, len(ids)))
    check_continuation(a, ids[:cut], ids[cut:])


@SKIP
@pytest.mark.parametrize("key", KEYS)
@SETTINGS
@given(data=st.data())
def test_cut_inside_characters_and_byte_runs(key: str, skip: bool, data: st.DataObject) -> None:
    """Prompts that end inside a character: byte-level pieces, byte-fallback runs."""
    a = get(key, skip)
    every, bytey, special = pools(key)
    token = st.one_of(st.sampled_from(bytey), st.sampled_from(every), st.sampled_from(special))
    head = data.draw(st.lists(token, max_size=6))
    run = data.draw(st.lists(st.sampled_from(bytey), min_size=1, max_size=6))
    tail = data.draw(st.lists(token, max_size=6))
    ids = head + run + tail
    cut = len(head) + data.draw(st.integers(0, len(run)))
    check_continuation(a, ids[:cut], ids[cut:])


@SKIP
@pytest.mark.parametrize("key", KEYS)
@SETTINGS
@given(data=st.data())
def test_special_tokens_in_the_prompt(key: str, skip: bool, data: st.DataObject) -> None:
    a = get(key, skip)
    _, _, special = pools(key)
    words = encode(a, data.draw(st.sampled_from(SAMPLES)))
    prompt = data.draw(st.lists(st.sampled_from(special), min_size=1, max_size=3))
    where = data.draw(st.integers(0, len(words)))
    prompt = words[:where] + prompt + data.draw(st.sampled_from([[], words[:2]]))
    check_continuation(a, prompt, words[where:])


@SKIP
@pytest.mark.parametrize("key", KEYS)
def test_right_after_bos(key: str, skip: bool) -> None:
    """The prompt is only BOS (or another special token): the first word keeps or loses
    its space exactly as decode(prompt + ids) does."""
    a = get(key, skip)
    _, _, special = pools(key)
    words = encode(a, "Paris is the capital of France. 東京")
    for s in special[:4]:
        check_continuation(a, [s], words)
        check_continuation(a, [s], [s, *words])
    check_continuation(a, [], words)


def test_space_of_the_first_generated_word_kept() -> None:
    """The issue's example: "The capital of France is" + ▁Paris is " Paris"."""
    a = get("llama2-spm", False)
    prompt = encode(a, "The capital of France is")
    paris = a.vocab.encode("The capital of France is Paris")[len(prompt) :]
    segs = check_continuation(a, [1, *prompt], paris)
    assert "".join(s.text for s in segs) == " Paris"


# -- ported from vLLM's tests/tokenization/test_detokenize.py -------------------------------

#: vLLM's TRUTH texts (test_detokenize.py), the special-token one aside.
VLLM_TRUTH = [
    "Hello here, this is a simple test",
    "vLLM is a high-throughput and memory-efficient inference and serving engine for LLMs. "
    "It is designed to be used in production environments, where inference and serving",
    "我很感谢你的热情",
    "ပုံပြင်လေးပြောပြပါ်",
    "น้ำประปาที่สะอาดช่วยให้ครูใหญ่มีสุขภาพดี",
    "ครูให้คำปรึกษาเรื่องน้ํากับส๎กฤต",
]
#: Stand-ins in the corpus for vLLM's TOKENIZERS list.
VLLM_KEYS = [
    "gpt2-json",  # openai-community/gpt2, facebook/opt-125m
    "neox-json",  # EleutherAI/pythia-70m
    "llama3-tiktoken",  # meta-llama/Llama-3.2-1B-Instruct
    "llama2-spm",  # codellama/CodeLlama-7b-hf (Llama 2 SPM)
    "llama2-hf-json",
    "gguf-falcon",  # tiiuae/falcon-7b
    "tekken",  # mistralai/Pixtral-12B-2409
    "demo-model",
]


def _bos_eos(a: Aligner) -> tuple[int | None, int | None]:
    names = {v: k for k, v in a.vocab.names.items()}
    bos = next((names[n] for n in ("<s>", "<|begin_of_text|>", "<｜begin▁of▁sentence｜>")
                if n in names), None)  # fmt: skip
    eos = next((names[n] for n in ("</s>", "<|end_of_text|>", "<|endoftext|>")
                if n in names), None)  # fmt: skip
    return bos, eos


@SKIP
@pytest.mark.parametrize("truth", VLLM_TRUTH)
@pytest.mark.parametrize("key", VLLM_KEYS)
def test_vllm_decode_streaming_with_prompt(key: str, truth: str, skip: bool) -> None:
    """vLLM `test_decode_streaming(with_prompt=True)`: BOS + text + EOS, the prompt being
    BOS and the tokens of the first half of the text. vLLM expects the continuation to be
    decode(all)[len(decode(prompt)):]; so do we wherever the prompt's decode is final
    (prompt_text is all of it: no open character, no byte-fallback run that a later
    byte could still turn into U+FFFD), and in every case prompt_text + continuation is
    the whole decode."""
    a = get(key, skip)
    bos, eos = _bos_eos(a)
    ids = encode(a, truth)
    n_prompt = len(encode(a, truth[: len(truth) // 2]))
    if bos is not None:
        ids, n_prompt = [bos, *ids], n_prompt + 1
    if eos is not None:
        ids = [*ids, eos]
    segs = check_continuation(a, ids[:n_prompt], ids[n_prompt:])
    whole = a.vocab.decode(ids, skip)
    prompt = a.vocab.decode(ids[:n_prompt], skip)
    if a.fresh(prompt_ids=ids[:n_prompt]).prompt_text == prompt:
        assert "".join(s.text for s in segs) == whole[len(prompt) :]


@pytest.mark.parametrize(
    ("key", "truth"),
    [
        (k, t)
        for k in ("gpt2-json", "llama3-tiktoken", "demo-model")
        for t in ("Hello world 🌶 is spicy", "สวัสดีครับ", "น้ำ", "น้ํา", "ส๎กฤต")
    ],
)
def test_vllm_prompt_ending_mid_character_does_not_leak(key: str, truth: str) -> None:
    """vLLM `test_incomplete_utf8_prompt_no_leak` and `test_thai_edge_case`: cut where the
    prompt's own decode ends in U+FFFD (an incomplete character). No prompt text leaks
    into the continuation, and the character completed by the continuation comes out
    with it, listing the prompt tokens that carry its first bytes."""
    a = get(key, True)
    ids = encode(a, truth)
    cuts = [i for i in range(1, len(ids)) if a.vocab.decode(ids[:i], True).endswith("\ufffd")]
    if not cuts:
        pytest.skip(f"{key} never splits a character of {truth!r}")
    for cut in cuts:
        segs = check_continuation(a, ids[:cut], ids[cut:])
        cont = "".join(s.text for s in segs)
        prompt_text = a.fresh(prompt_ids=ids[:cut]).prompt_text
        assert cont == a.vocab.decode(ids, True)[len(prompt_text) :]
        carried = [t.index for s in segs for t in s.tokens if t.index < 0]
        assert carried and carried[0] >= -4, "the open tail's prompt tokens are listed"


@pytest.mark.parametrize("key", VLLM_KEYS)
def test_vllm_oov_token_is_a_clear_error(key: str) -> None:
    """vLLM `test_oov_decode` streams id len(tokenizer) as ""; an id outside the
    vocabulary is a ValueError naming it here, in the prompt and in the continuation."""
    a = get(key, True)
    n = a.vocab.size
    with pytest.raises(ValueError, match=f"token id {n} is outside"):
        a.fresh(prompt_ids=None).push(n)
    with pytest.raises(ValueError, match=f"prompt_ids: token id {n}"):
        a.fresh(prompt_ids=[n])


def test_sentencepiece_strips_every_prefix_until_text_comes_out() -> None:
    """Found by the properties above: with remove_extra_whitespaces (T5), sentencepiece
    strips the dummy prefix of every piece while its output is still empty, so a lone
    "▁" first leaves the next "▁" first too; Llama 2's model strips only the first."""
    for key in ("t5-spm-unigram", "llama2-spm"):
        for skip in (False, True):
            a = get(key, skip)
            sp = a.vocab.source
            space = sp.piece_to_id("▁")
            for ids in ([space, 0, space, 2], [space, space, 300], [1, space, 1, space, 300]):
                check_continuation(a, [], ids)
                check_continuation(a, ids[:1], ids[1:])
                check_continuation(a, ids[:2], ids[2:])
