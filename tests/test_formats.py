"""GGUF vocabularies, Mistral Tekken and llama2.c tokenizer.bin, checked against their oracles.

Oracles (see tokentrail.vocab.gguf_file, .tekken, .llama2c):
- GGUF with reference="transformers" (the default, llama.cpp, is tested against
  llama.cpp itself in test_gguf_llamacpp.py): the tokenizer transformers builds from the
  file (Llama SPM, DeepSeek Coder, Falcon); where transformers cannot build one, the
  file rebuilt as a sentencepiece model (Baichuan) or a tokenizers WordPiece (BGE). Two
  files are also checked through the rebuild alone (use_transformers=False).
- Tekken: mistral-common's Tekkenizer.decode with SpecialTokenPolicy IGNORE / KEEP.
- llama2.c: sentencepiece on the model rebuilt from the export, itself checked against
  sentencepiece on Llama 2's tokenizer.model and against the corpus's recorded llama2.c
  decode of a real model's greedy output.
"""

from __future__ import annotations

import functools
import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.helpers.env import CORPUS, corpus_path, require
from tests.helpers.tokenizer_specs import takes_first_piece
from tokentrail import Aligner, Segment, TokenizerLoadError, Vocab
from tokentrail.vocab.gguf_file import vocab_from_gguf
from tokentrail.vocab.llama2c import try_llama2c
from tokentrail.vocab.tekken import vocab_from_tekken

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Don't stop, it's fine!",
    "int main() {\n\tif (x  ==  1)\t{\n\t\treturn    0;\n\t}\r\n}\r\n",
    "北京欢迎你。東京は晴れです。서울의 밤하늘",
    "السلام عليكم، كيف حالك؟ ١٢٣",
    "हिन्दी में लिखा गया वाक्य।",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "👩‍💻 🧑🏿‍🚀 🇩🇪🇧🇷 👋🏻👋🏾 🏴‍☠️ 1️⃣",
    "a\u0301 o\u0302\u0323 q\u0307\u0308\u0309 Å vs A\u030a",
    "   leading spaces, trailing   \n\n\n\t\t mixed \u00a0nbsp\u3000ideographic",
    "Ünïcödé façade — “smart” quotes … 50 % ½ ∑ ∞",
]


def _tekken_file(name: str) -> Path:
    require("mistral_common")
    import mistral_common

    path = Path(mistral_common.__file__).parent / "data" / name
    if not path.is_file():
        pytest.skip(f"{name} is not shipped with this mistral-common version")
    return path


# (test id, how to load it, corpus path or tekken file name)
SPECS = [
    ("gguf-llama-spm", "path", "tokenizers/llama2/ggml-vocab-llama-spm.gguf"),
    ("gguf-baichuan", "path", "tokenizers/baichuan/ggml-vocab-baichuan.gguf"),
    ("gguf-bert-bge", "path", "tokenizers/bert/ggml-vocab-bert-bge.gguf"),
    ("gguf-deepseek-coder", "path", "tokenizers/deepseek/ggml-vocab-deepseek-coder.gguf"),
    ("gguf-falcon", "path", "tokenizers/falcon/ggml-vocab-falcon.gguf"),
    ("gguf-llama-spm-rebuilt", "rebuilt", "tokenizers/llama2/ggml-vocab-llama-spm.gguf"),
    ("gguf-deepseek-rebuilt", "rebuilt", "tokenizers/deepseek/ggml-vocab-deepseek-coder.gguf"),
    ("tekken-240911-path", "tekken-path", "tekken_240911.json"),
    ("tekken-240718-object", "tekken-object", "tekken_240718.json"),
    ("llama2c-llama2", "path", "tokenizers/llama2/tokenizer.bin"),
    ("llama2c-tok512", "path", "models/aidreams260K/tok512.bin"),
]
KEYS = [s[0] for s in SPECS]


def _spec(key: str) -> tuple[str, str]:
    _, how, where = next(s for s in SPECS if s[0] == key)
    return how, where


@functools.cache
def _load(key: str) -> Vocab:
    how, where = _spec(key)
    if how == "path" and where.endswith(".gguf"):
        # llama.cpp (the default reference) is checked in test_gguf_llamacpp.py
        return Aligner(str(CORPUS / where), reference="transformers").vocab
    if how == "path":
        return Aligner(str(CORPUS / where)).vocab
    if how == "rebuilt":
        return vocab_from_gguf(CORPUS / where, use_transformers=False, reference="transformers")
    if how == "tekken-path":
        return Aligner(str(_tekken_file(where))).vocab
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return Aligner(MistralTokenizer.from_file(str(_tekken_file(where)))).vocab


def _vocab(key: str) -> Vocab:
    how, where = _spec(key)
    if how.startswith("tekken"):
        _tekken_file(where)
    else:
        corpus_path(where)
    return _load(key)


def _encode(v: Vocab, text: str) -> list[int]:
    from_tekken = type(v.source).__name__ == "Tekkenizer"
    return v.source.encode(text, bos=False, eos=False) if from_tekken else v.encode(text)


@functools.cache
def _pools(key: str) -> tuple[list[int], list[int], list[int]]:
    """(every id, ids of byte tokens or of pieces that are not valid UTF-8, special ids)."""
    v = _load(key)
    every = [i for i, p in enumerate(v.pieces) if p is not None]
    partial = sorted(v.byte_ids) or [i for i in every if v.texts[i] is None] or every
    special = sorted(v.special | v.hidden) or every[:1]
    return every, partial, special


def _own_bytes(v: Vocab, ids: list[int], skip: bool, index: int) -> bytes:
    """The bytes token `index` adds to this stream (first-piece rules included)."""
    skipped = v.hidden | (v.special if skip else frozenset())
    if ids[index] in skipped:
        return b""
    if ids[index] in v.first_pieces and takes_first_piece(v, skipped, ids[:index]):
        return v.first_pieces[ids[index]]
    return v.pieces[ids[index]] or b""


def check(v: Vocab, ids: list[int], skip: bool) -> None:
    """Exactness against the oracle and byte-exact attribution, streamed token by token."""
    aligner = Aligner(v, skip_special_tokens=skip)
    segments: list[Segment] = []
    for i in ids:
        out = aligner.push(i, logprob=-1.0)
        assert len(out) <= 1
        segments.extend(out)
    segments.extend(aligner.finish())
    # (a) the segments' text is the oracle's decode
    assert "".join(s.text for s in segments) == v.decode(ids, skip), (ids, skip)
    # (b) every token is attributed, in order, and its bytes exactly once
    covered: dict[int, int] = {}
    last = -1
    leading = True
    for seg in segments:
        assert seg.tokens
        for t in seg.tokens:
            assert t.index >= last and t.id == ids[t.index]
            last = t.index
            assert t.start == covered.get(t.index, 0) and t.start <= t.end
            covered[t.index] = t.end
        own = b"".join(_own_bytes(v, ids, skip, t.index)[t.start : t.end] for t in seg.tokens)
        if "\ufffd" not in seg.text and v.generic is None and not v.cleanup:
            text = own.decode("utf-8")
            if leading and v.strip_leading:  # a stripped leading space is consumed, unshown
                assert text.endswith(seg.text) and not text[: len(text) - len(seg.text)].strip(" ")
            else:
                assert text == seg.text, (ids, skip, text, seg.text)
        leading = leading and not seg.text
    assert sorted(covered) == list(range(len(ids)))
    for k in range(len(ids)):
        assert covered[k] == len(_own_bytes(v, ids, skip, k)), f"token {k} not fully attributed"


SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.corpus
@pytest.mark.parametrize("key", KEYS)
@SETTINGS
@given(data=st.data())
def test_encoded_text_is_exact(key: str, data: st.DataObject) -> None:
    v = _vocab(key)
    text = data.draw(
        st.one_of(
            st.sampled_from(TEXTS),
            st.lists(st.sampled_from(TEXTS), min_size=2, max_size=3).map("".join),
            st.text(max_size=30),
        )
    )
    ids = _encode(v, text)
    assume(ids)
    _, _, special = _pools(key)
    for _ in range(data.draw(st.integers(0, 3))):  # specials between real tokens
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from(special)))
    for skip in (False, True):
        check(v, ids, skip)


@pytest.mark.corpus
@pytest.mark.parametrize("key", KEYS)
@SETTINGS
@given(data=st.data())
def test_random_ids_are_exact(key: str, data: st.DataObject) -> None:
    v = _vocab(key)
    every, partial, special = _pools(key)
    pools = {
        "uniform": st.sampled_from(every),
        "bytes": st.sampled_from(partial),
        "special": st.one_of(st.sampled_from(special), st.sampled_from(partial)),
        "mixed": st.one_of(
            st.sampled_from(every), st.sampled_from(partial), st.sampled_from(special)
        ),
    }
    pool = pools[data.draw(st.sampled_from(sorted(pools)))]
    ids = data.draw(st.lists(pool, min_size=1, max_size=24))
    for skip in (False, True):
        check(v, ids, skip)


# -- ids and files that are not tokenizers ----------------------------------------------------


@pytest.mark.corpus
@pytest.mark.parametrize("key", KEYS)
def test_out_of_range_id_raises_naming_it(key: str) -> None:
    v = _vocab(key)
    aligner = Aligner(v)
    for bad in (v.size, v.size + 7, -1):
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary"):
            aligner.push(bad)


def test_random_binary_file_is_rejected(tmp_path: Path) -> None:
    junk = tmp_path / "random.bin"
    junk.write_bytes(b"\x07" + random.Random(1234).randbytes(8191))
    assert try_llama2c(junk) is None
    with pytest.raises(TokenizerLoadError, match="not a recognised tokenizer file"):
        Aligner(str(junk))


@pytest.mark.corpus
def test_damaged_llama2c_files_are_rejected(tmp_path: Path) -> None:
    data = corpus_path("models/aidreams260K/tok512.bin").read_bytes()
    cut = tmp_path / "cut.bin"
    cut.write_bytes(data[:-3])  # the last piece is short
    assert try_llama2c(cut) is None
    longer = tmp_path / "longer.bin"
    longer.write_bytes(struct.pack("<i", 11) + data[4:])  # no piece reaches the stated max
    assert try_llama2c(longer) is None
    nan = tmp_path / "nan.bin"
    nan.write_bytes(data[:4] + struct.pack("<f", float("nan")) + data[8:])
    assert try_llama2c(nan) is None
    for path in (cut, longer, nan):
        with pytest.raises(TokenizerLoadError):
            Aligner(str(path))


def test_truncated_gguf_raises_load_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 5) + b"\x01\x02")
    with pytest.raises(TokenizerLoadError, match="GGUF"):
        Aligner(str(bad))


# -- GGUF ---------------------------------------------------------------------------------------


@pytest.mark.corpus
def test_gguf_oracles_are_the_documented_ones() -> None:
    origin = {key: _vocab(key).name.rsplit("(", 1)[1] for key in KEYS if key.startswith("gguf")}
    assert origin == {
        "gguf-llama-spm": "transformers)",
        "gguf-baichuan": "sentencepiece)",
        "gguf-bert-bge": "tokenizers WordPiece)",
        "gguf-deepseek-coder": "transformers)",
        "gguf-falcon": "transformers)",
        "gguf-llama-spm-rebuilt": "sentencepiece)",
        "gguf-deepseek-rebuilt": "tokenizers BPE)",
    }


@pytest.mark.corpus
def test_llama_gguf_matches_llama2_sentencepiece_model() -> None:
    """The GGUF, through transformers or rebuilt, has tokenizer.model's pieces (the three
    special ones aside, which transformers shows by name), and the rebuilt model decodes
    every id sequence exactly as tokenizer.model does."""
    spm = Aligner(str(corpus_path("tokenizers/llama2/tokenizer.model"))).vocab
    via_hf, rebuilt = _vocab("gguf-llama-spm"), _vocab("gguf-llama-spm-rebuilt")
    assert rebuilt.pieces == spm.pieces and via_hf.pieces[3:] == spm.pieces[3:]
    assert via_hf.pieces[:3] == [b"<unk>", b"<s>", b"</s>"] and via_hf.special == {0, 1, 2}
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.choice([rng.randrange(32000), rng.randrange(3, 259)]) for _ in range(12)]
        assert rebuilt.decode(ids) == spm.decode(ids)


@pytest.mark.corpus
def test_deepseek_control_tokens_follow_the_file() -> None:
    """transformers leaves DeepSeek's BOS/EOS (control in the GGUF) as normal tokens and
    adds copies past the file's 32256 ids; the vocab keeps the file's ids and types."""
    v = _vocab("gguf-deepseek-coder")
    assert v.size == 32256 and {32013, 32014} <= v.special
    hello = _encode(v, "print('hi')")
    ids = [32013, *hello, 32014]
    for skip, expected in (
        (True, "print('hi')"),
        (False, "<｜begin▁of▁sentence｜>print('hi')<｜end▁of▁sentence｜>"),
    ):
        assert v.decode(ids, skip) == expected
        check(v, ids, skip)
    assert v.names[32014] == "<｜end▁of▁sentence｜>"
    with pytest.raises(ValueError, match="token id 32257"):
        Aligner(v).push(32257)
    rebuilt = _vocab("gguf-deepseek-rebuilt")
    assert rebuilt.pieces == v.pieces and rebuilt.special == v.special


@pytest.mark.corpus
def test_bert_gguf_wordpiece_decode() -> None:
    v = _vocab("gguf-bert-bge")
    ids = _encode(v, "Hello, World! Tokenization is fun.")
    assert v.decode(ids) == "hello, world! tokenization is fun."
    cls, sep = v.source.token_to_id("[CLS]"), v.source.token_to_id("[SEP]")
    assert v.decode([cls, *ids, sep], False).startswith("[CLS] hello")
    check(v, [cls, *ids, sep], True)
    check(v, [cls, *ids, sep], False)


# -- Tekken --------------------------------------------------------------------------------------


def test_tekken_path_and_objects_compile_alike() -> None:
    require("mistral_common")
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    path = _tekken_file("tekken_240911.json")
    wrapped = MistralTokenizer.from_file(str(path))
    by_path = vocab_from_tekken(path)
    for obj in (wrapped, wrapped.instruct_tokenizer, Tekkenizer.from_file(path)):
        v = vocab_from_tekken(obj)
        assert v.pieces == by_path.pieces and v.special == by_path.special
    n = by_path.source.num_special_tokens
    assert by_path.special == frozenset(range(n)) and by_path.names[1] == "<s>"


def test_tekken_ignored_special_token_splits_a_character() -> None:
    """Tekkenizer decodes each run of non-special tokens on its own, so an ignored special
    token between the bytes of one character turns both halves into U+FFFD (one for the
    incomplete lead byte, one for each stray continuation byte)."""
    v = _vocab("tekken-240911-path")
    n = v.source.num_special_tokens
    e4, b8, ad = (n + b for b in (0xE4, 0xB8, 0xAD))  # 中 is E4 B8 AD
    ids = [e4, 1, b8, ad, 2]
    assert v.decode(ids, True) == "\ufffd" * 3
    assert v.decode(ids, False) == "\ufffd<s>\ufffd\ufffd</s>"
    assert v.decode([e4, b8, ad], True) == "中"
    for skip in (False, True):
        check(v, ids, skip)


# -- llama2.c ------------------------------------------------------------------------------------


@pytest.mark.corpus
def test_llama2c_bin_decodes_like_llama2_tokenizer_model() -> None:
    """The brief's oracle for llama2.c: sentencepiece on the same vocabulary's .model."""
    spm = Aligner(str(corpus_path("tokenizers/llama2/tokenizer.model"))).vocab
    v = _vocab("llama2c-llama2")
    assert v.size == spm.size and v.pieces == spm.pieces
    rng = random.Random(3)
    for _ in range(300):
        ids = [rng.choice([rng.randrange(32000), rng.randrange(259), 1]) for _ in range(16)]
        assert v.decode(ids) == spm.decode(ids)
        got = "".join(s.text for s in Aligner(v).align(ids))
        assert got == spm.decode(ids)


@pytest.mark.corpus
def test_llama2c_greedy_output_of_real_model() -> None:
    """The corpus records aidreams260K's greedy ids and their llama2.c decode."""
    manifest = json.loads(corpus_path("tokenizers/MANIFEST.json").read_text(encoding="utf-8"))
    record: dict[str, Any] = next(m for m in manifest["models"] if m["id"] == "aidreams260K")
    ids = record["verification"]["greedy_token_ids"]
    v = _vocab("llama2c-tok512")
    segments = Aligner(v).align([1, *ids])
    assert "".join(s.text for s in segments) == record["verification"]["greedy_text"]
    assert v.names[1] == "<s>" and v.token_text(1) == "<s>"


@pytest.mark.corpus
def test_mistral_common_sentencepiece_wrapper_compiles_as_its_model() -> None:
    """Pre-Tekken mistral-common tokenizers wrap a sentencepiece model: same decode."""
    require("mistral_common")
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    path = corpus_path("tokenizers/mistral/mistral_instruct_tokenizer_240323.model.v3")
    inner = MistralTokenizer.from_file(str(path)).instruct_tokenizer.tokenizer
    v = vocab_from_tekken(MistralTokenizer.from_file(str(path)))
    ids = inner.encode(TEXTS[2] + TEXTS[6], bos=True, eos=True)
    assert "".join(s.text for s in Aligner(v).align(ids)) == inner.decode(ids)
    check(v, [3, *ids, 4], False)
