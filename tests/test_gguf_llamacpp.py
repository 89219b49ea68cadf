"""GGUF files decoded as llama.cpp decodes them, with llama.cpp itself as the oracle.

The oracle is llama-cpp-python: `Llama(model_path, vocab_only=True)` and the low-level
`llama_cpp.llama_token_to_piece(vocab, id, buf, size, lstrip=0, special)`, every id's
piece concatenated and decoded as UTF-8 with maximal-subpart replacement (what
llama-server sends; see tokentrail.vocab.gguf_llamacpp). `skip_special_tokens=False` is
`special=True`.

The GGUF files are every ggml-vocab-*.gguf of the corpus; llama.cpp's own tokenizer-test
vocabularies that the corpus does not hold (``models/ggml-vocab-*.gguf`` of the llama.cpp
tree llama-server is built from: 14 more families, Gemma 4, Qwen 3.5, Command R, Phi-3,
Llama 3, StarCoder and MPT among them, never used to build tokentrail's rules);
SmolLM2-135M-Instruct (a real instruct model, where `python -m tokentrail.models fetch
smollm2` put it, as CI does) and vocabularies written here with the gguf package from
corpus data, for the rules no corpus file exercises: UGM (T5's sentencepiece model as a
`t5` GGUF) and a byte-level BPE vocabulary (the demo model's) carrying user-defined,
unused, undefined, byte and re-typed tokens.

These tests run wherever llama-cpp-python is importable (CI installs it).
"""

from __future__ import annotations

import ctypes
import functools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tokentrail
from tests.helpers.env import CORPUS, corpus_path, missing, require
from tests.helpers.gguf_files import finish, vocab_writer
from tests.helpers.llamacpp import find_smollm2, llama_cpp_tree
from tokentrail import Aligner, TokenizerLoadError
from tokentrail.generate import DEMO_MODEL

llama_cpp = pytest.importorskip(
    "llama_cpp",
    reason="llama-cpp-python is not installed: it is the oracle for reference='llama.cpp' "
    "(pip install llama-cpp-python; CI installs it)",
)


CORPUS_GGUF = {
    "llama-spm": "tokenizers/llama2/ggml-vocab-llama-spm.gguf",
    "baichuan": "tokenizers/baichuan/ggml-vocab-baichuan.gguf",
    "bert-bge": "tokenizers/bert/ggml-vocab-bert-bge.gguf",
    "deepseek-coder": "tokenizers/deepseek/ggml-vocab-deepseek-coder.gguf",
    "falcon": "tokenizers/falcon/ggml-vocab-falcon.gguf",
}
#: llama.cpp's tokenizer-test vocabularies in its own tree (`llama_cpp_tree`), those of
#: families the corpus does not hold (llama.cpp 0.3.36's models/ folder).
LLAMA_CPP_GGUF = (
    "aquila", "command-r", "deepseek-llm", "gemma-4", "gpt-2", "gpt-neox", "llama-bpe",
    "mpt", "nomic-bert-moe", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
)  # fmt: skip
KEYS = [*CORPUS_GGUF, *LLAMA_CPP_GGUF, "smollm2", "t5-ugm", "bpe-quirks"]

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n\treturn x**2  # tabs\tand    spaces\r\n",
    "你好世界，这是一个测试。日本語のテキストです。안녕하세요 세계",
    "مرحبا بالعالم، هذا اختبار. ٤٠٠",
    "नमस्ते दुनिया, यह एक परीक्षण है।",
    "สวัสดีชาวโลก",
    "Emoji: 🙂 👍🏽 🇫🇷🇯🇵 👨‍👩‍👧‍👦",
    "Accents: café naïve Ångström — “quotes” …  n't 's .,!?",
]


# -- the GGUF files -------------------------------------------------------------------------


_FOLDER: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def gguf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session-wide temporary folder for the GGUF files these tests write or unzip."""
    _FOLDER.append(tmp_path_factory.mktemp("gguf"))
    return _FOLDER[-1]


def _write_t5(path: Path) -> Path:
    """T5's sentencepiece (unigram) model as a `t5` (UGM) GGUF vocabulary."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(corpus_path("tokenizers", "t5", "spiece.model")))
    n = sp.get_piece_size()
    w = vocab_writer(path, "t5")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_types([3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 1 for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_eos_token_id(1)
    w.add_unk_token_id(2)
    finish(w)
    return path


#: Tokens appended to the demo model's byte-level BPE vocabulary, with their GGUF type:
#: the cases llama.cpp treats by type or re-types by text.
QUIRKS = [
    ("</s>", 4),  # user-defined, but an end-of-generation text: becomes control
    ("<｜fim▁begin｜>", 1),  # DeepSeek FIM marker left normal: becomes control
    ("<|fim_middle|>", 4),  # Qwen FIM marker left user-defined: becomes control
    ("<|channel|>", 3),  # gpt-oss: always rendered (user-defined)
    ("<|im_sep|>", 3),
    ("ČĊ", 4),  # user-defined: its UTF-8 text, not byte-level decoded
    ("na日e", 1),  # normal with characters outside the byte alphabet: [UNK_BYTE_...]
    ("<0xE4>", 6),  # a byte token in a BPE vocabulary: the raw byte
    ("<0xBD>", 6),
    ("<unused_0>", 5),  # unused: nothing
    ("<undefined>", 0),  # undefined: nothing
    ("<mask>", 2),  # unknown: hidden unless special
    ("<|reserved_unused_1|>", 3),  # control with "unused" in its text
]


def _write_bpe_quirks(path: Path) -> Path:
    spec = json.loads((DEMO_MODEL / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [1] * len(tokens)
    for added in spec.get("added_tokens", []):
        types[added["id"]] = 3 if added.get("special") else 4
    for t, kind in QUIRKS:
        assert t not in vocab, t  # llama.cpp aborts on duplicate tokens
        tokens.append(t)
        types.append(kind)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w = vocab_writer(path, "gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    finish(w)
    return path


@functools.cache
def _built(key: str) -> Path:
    folder = _FOLDER[-1]
    if key == "t5-ugm":
        return _write_t5(folder / "t5.gguf")
    if key == "bpe-quirks":
        return _write_bpe_quirks(folder / "bpe-quirks.gguf")
    if key == "smollm2":
        return find_smollm2()
    raise KeyError(key)


def gguf_path(key: str) -> Path:
    if key in CORPUS_GGUF:
        return corpus_path(CORPUS_GGUF[key])
    if key in LLAMA_CPP_GGUF:
        path = llama_cpp_tree() / "models" / f"ggml-vocab-{key}.gguf"
        if not path.is_file():
            missing(f"{path} is missing from the llama.cpp tree")
        return path
    return _built(key)


# -- the oracle ---------------------------------------------------------------------------


class LlamaCpp:
    """llama.cpp's own pieces for one GGUF vocabulary (vocab_only)."""

    def __init__(self, path: Path) -> None:
        self.model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = self.model._model.vocab
        self.n = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self._buf = ctypes.create_string_buffer(1 << 16)
        self._cache: dict[tuple[int, bool], bytes] = {}

    def piece(self, token: int, special: bool) -> bytes:
        hit = self._cache.get((token, special))
        if hit is None:
            k = llama_cpp.llama_token_to_piece(self.vocab, token, self._buf, 1 << 16, 0, special)
            assert k >= 0
            hit = self._cache[(token, special)] = self._buf.raw[:k]
        return hit

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        data = b"".join(self.piece(i, not skip_special_tokens) for i in ids)
        return data.decode("utf-8", "replace")

    def encode(self, text: str) -> list[int]:
        return self.model.tokenize(text.encode("utf-8"), add_bos=False, special=False)


@functools.cache
def oracle(key: str) -> LlamaCpp:
    return LlamaCpp(gguf_path(key))


@functools.cache
def aligner(key: str, skip: bool) -> Aligner:
    return Aligner(gguf_path(key), skip_special_tokens=skip)


@functools.cache
def pools(key: str) -> tuple[list[int], list[int], list[int]]:
    """(all ids, ids whose piece is not valid UTF-8 alone, special ids)."""
    o = oracle(key)
    everything = list(range(o.n))
    bytey = []
    for i in everything:
        try:
            o.piece(i, True).decode("utf-8")
        except UnicodeDecodeError:
            bytey.append(i)
    special = sorted(aligner(key, False).vocab.special) or everything[:1]
    return everything, bytey or everything, special


# -- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", KEYS)
def test_every_piece_equals_llama_token_to_piece(key: str) -> None:
    o = oracle(key)
    v = aligner(key, False).vocab
    assert v.size == o.n
    for special in (True, False):
        ours = [(v.pieces[i] or b"") if special or i not in v.special else b"" for i in range(o.n)]
        theirs = [o.piece(i, special) for i in range(o.n)]
        bad = [(i, a, b) for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
        assert not bad, f"special={special}: {len(bad)} pieces differ, first {bad[:5]}"


@pytest.mark.parametrize("key", KEYS)
def test_end_of_generation_ids_are_llama_cpps(key: str) -> None:
    """`gguf_eog_ids`: the ids `llama_vocab_is_eog` is true of, where the proxy ends a
    llama-server answer (its EOS, EOT and EOM ids and the markers found by text)."""
    from tokentrail.vocab.gguf_file import gguf_eog_ids

    o = oracle(key)
    theirs = {i for i in range(o.n) if llama_cpp.llama_vocab_is_eog(o.vocab, i)}
    assert gguf_eog_ids(gguf_path(key)) == theirs


def _stream(a: Aligner, ids: list[int]) -> list[tokentrail.Segment]:
    segs = [s for i in ids for s in a.push(i)]
    return segs + a.finish()


def _check(key: str, ids: list[int], skip: bool) -> None:
    a = aligner(key, skip).fresh(prompt_ids=None)
    segs = _stream(a, ids)
    assert "".join(s.text for s in segs) == oracle(key).decode(ids, skip)
    starts = [t.index for s in segs for t in s.tokens if t.start == 0]
    assert sorted(set(starts)) == list(range(len(ids)))


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("skip", [False, True], ids=["keep-special", "skip-special"])
@pytest.mark.parametrize("key", KEYS)
@SETTINGS
@given(data=st.data())
def test_random_ids_match_llama_cpp(key: str, skip: bool, data: st.DataObject) -> None:
    everything, bytey, special = pools(key)
    ids = data.draw(
        st.lists(
            st.one_of(
                st.sampled_from(everything), st.sampled_from(bytey), st.sampled_from(special)
            ),
            max_size=40,
        )
    )
    _check(key, ids, skip)


@pytest.mark.parametrize("skip", [False, True], ids=["keep-special", "skip-special"])
@pytest.mark.parametrize("key", KEYS)
@SETTINGS
@given(data=st.data())
def test_encoded_text_matches_llama_cpp(key: str, skip: bool, data: st.DataObject) -> None:
    text = data.draw(
        st.one_of(
            st.sampled_from(TEXTS),
            st.lists(st.sampled_from(TEXTS), min_size=2, max_size=3).map("".join),
            st.text(max_size=30),
        )
    )
    ids = oracle(key).encode(text)
    _, _, special = pools(key)
    where = data.draw(st.integers(0, len(ids)))
    ids = ids[:where] + data.draw(st.lists(st.sampled_from(special), max_size=2)) + ids[where:]
    _check(key, ids, skip)


@pytest.mark.parametrize("skip", [False, True], ids=["keep-special", "skip-special"])
@pytest.mark.parametrize("key", KEYS)
@SETTINGS
@given(data=st.data())
def test_continuation_matches_llama_cpp(key: str, skip: bool, data: st.DataObject) -> None:
    _, bytey, special = pools(key)
    text = data.draw(st.sampled_from(TEXTS))
    ids = oracle(key).encode(text)
    ids = data.draw(st.lists(st.sampled_from(special), max_size=1)) + ids
    ids = ids + data.draw(st.lists(st.sampled_from(bytey), max_size=3))
    cut = data.draw(st.integers(0, len(ids)))
    a = aligner(key, skip).fresh(prompt_ids=ids[:cut])
    segs = _stream(a, ids[cut:])
    assert a.prompt_text + "".join(s.text for s in segs) == oracle(key).decode(ids, skip)
    cont = [t.index for s in segs for t in s.tokens if t.index >= 0 and t.start == 0]
    assert cont == list(range(len(ids) - cut))


def test_no_space_stripped_after_bos_and_specials_shown_as_text() -> None:
    o = oracle("llama-spm")
    ids = [1, *o.encode("Hello world"), 2, 0]
    assert o.encode("Hello world")[0] == 15043  # "▁Hello"
    keep = "".join(s.text for s in aligner("llama-spm", False).align(ids))
    skip = "".join(s.text for s in aligner("llama-spm", True).align(ids))
    assert keep == o.decode(ids, False) == "<s> Hello world</s><unk>"
    assert skip == o.decode(ids, True) == " Hello world"


def test_deepseek_user_defined_and_fim_tokens() -> None:
    o = oracle("deepseek-coder")
    v = aligner("deepseek-coder", False).vocab
    # 32000-32012 are user-defined: their UTF-8 text whatever skip_special_tokens says
    for i in range(32000, 32013):
        assert i not in v.special
        assert v.pieces[i] == o.piece(i, False) == o.piece(i, True) != b""
    # the FIM markers are re-typed control: hidden when special tokens are skipped
    fim = [v.encode(t) for t in ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")]
    for (i,) in fim:
        assert i in v.special and o.piece(i, False) == b"" and o.piece(i, True)


def test_bpe_quirk_tokens_follow_llama_cpp() -> None:
    o = oracle("bpe-quirks")
    v = aligner("bpe-quirks", False).vocab
    base = o.n - len(QUIRKS)
    by_text = {t: base + k for k, (t, _) in enumerate(QUIRKS)}
    assert o.piece(by_text["</s>"], False) == b"" and by_text["</s>"] in v.special
    assert o.piece(by_text["<|channel|>"], False) == b"<|channel|>"
    assert o.piece(by_text["ČĊ"], True) == "ČĊ".encode()
    assert o.piece(by_text["na日e"], True) == "na[UNK_BYTE_0xe697a5na日e]e".encode()
    assert o.piece(by_text["<0xE4>"], True) == b"\xe4"
    assert o.piece(by_text["<unused_0>"], True) == o.piece(by_text["<undefined>"], True) == b""
    ids = [by_text["<0xE4>"], by_text["<0xBD>"], by_text["<0xBD>"], by_text["<mask>"]]
    for skip in (False, True):
        text = "".join(s.text for s in aligner("bpe-quirks", skip).align(ids))
        assert text == o.decode(ids, skip)
    assert "".join(s.text for s in aligner("bpe-quirks", True).align(ids)) == "\u4f7d"  # E4 BD BD


def test_reference_transformers_keeps_the_old_decode() -> None:
    path = gguf_path("deepseek-coder")
    require("transformers")
    require("torch")
    v = tokentrail.load_vocab(path, reference="transformers")
    assert "(transformers)" in v.name
    ids = [32000, 32001]  # user-defined: transformers gives lone bytes, llama.cpp text
    assert v.decode(ids) != oracle("deepseek-coder").decode(ids, False)
    assert tokentrail.load_vocab(path, reference="llama.cpp").decode(ids) == oracle(
        "deepseek-coder"
    ).decode(ids, False)


def test_reference_transformers_without_torch_names_the_extra(monkeypatch) -> None:
    import importlib.util

    path = gguf_path("llama-spm")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    with pytest.raises(TokenizerLoadError, match=r"pip install 'tokentrail\[gguf,torch\]'"):
        Aligner(path, reference="transformers")
    # the llama.cpp reference needs neither transformers nor torch
    assert Aligner(path, reference="llama.cpp").vocab.decode([1, 15043]) == "<s> Hello"


def test_reference_that_does_not_apply_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="reference must be one of"):
        Aligner(gguf_path("llama-spm"), reference="vllm")
    with pytest.raises(ValueError, match=r"reference='llama.cpp' does not apply"):
        Aligner(DEMO_MODEL / "tokenizer.json", reference="llama.cpp")
    if CORPUS.exists():
        with pytest.raises(ValueError, match="SentencePiece model"):
            spm = corpus_path("tokenizers", "llama2", "tokenizer.model")
            Aligner(spm, reference="transformers")
    # "transformers" is the auto reference of Hugging Face files: accepted, same decode
    a = Aligner(DEMO_MODEL / "tokenizer.json", reference="transformers")
    assert a.vocab.decode([5, 6]) == Aligner(DEMO_MODEL / "tokenizer.json").vocab.decode([5, 6])


@pytest.mark.parametrize("key", ["gemma-4", "command-r", "mpt"])
def test_the_proxy_reads_a_gguf_transformers_cannot_with_llama_cpps_tokenizer(key: str) -> None:
    """`serve --upstream URL --tokenizer FILE.gguf` for a GGUF that transformers builds
    no tokenizer from (it was refused): llama.cpp's own tokenizer, as llama-server
    tokenizes. Its vocabulary decodes as llama.cpp does, its end ids are llama.cpp's
    end-of-generation set, and a chat rendered with the file's template reads back."""
    require("transformers")
    from tokentrail.engines.llamacpp.engine import LlamaCppTokenizer
    from tokentrail.prompting import eos_ids, vocab_for
    from tokentrail.server.proxy import load_tokenizer
    from tokentrail.vocab.gguf_file import gguf_eog_ids

    path = gguf_path(key)
    tok = load_tokenizer(path)
    assert isinstance(tok, LlamaCppTokenizer)  # transformers built none from it
    o = oracle(key)
    vocab = vocab_for(tok)
    everything, bytey, special = pools(key)
    rng = random.Random(7)
    for _ in range(50):
        ids = [rng.choice(rng.choice((everything, bytey, special))) for _ in range(20)]
        for skip in (False, True):
            assert vocab.decode(ids, skip_special_tokens=skip) == o.decode(ids, skip)
    for text in TEXTS:
        assert o.decode(tok.encode(text, add_special_tokens=False), False) == text
    assert set(eos_ids(tok)) == gguf_eog_ids(path)
    if o.model.metadata.get("tokenizer.chat_template"):
        messages = [{"role": "user", "content": "Name a colour."}]
        text = tok.apply_chat_template(messages, tokenize=False)
        ids = tok.apply_chat_template(messages)
        assert "Name a colour." in text and vocab.decode(ids, skip_special_tokens=False) == text


def test_a_process_holding_llama_cpps_tokenizer_exits_without_noise() -> None:
    """The proxy's llama.cpp tokenizer (a vocabulary-only `Llama`) is closed before the
    interpreter tears its modules down: nothing on stderr at exit (llama-cpp-python's own
    `__del__` at shutdown printed "Exception ignored ... TypeError: 'NoneType' object is
    not callable" on every exit of the proxy)."""
    require("transformers")
    require("llama_cpp")
    path = gguf_path("mpt")
    code = (
        "import sys\n"
        "from tokentrail.server.proxy import load_tokenizer\n"
        f"tok = load_tokenizer({str(path)!r})\n"
        "assert type(tok).__name__ == 'LlamaCppTokenizer', type(tok)\n"
        "print(len(tok.encode('hello world')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 0
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, (
        done.stderr[-2000:]
    )
