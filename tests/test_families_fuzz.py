"""Differential tests on tokenizer files built with the libraries themselves (issue 20,
"Exact on the last families"): the aligner's text against the library's own decode.

- tokenizer.json over a grid of normalizers, Metaspace schemas (old `add_prefix_space` /
  `str_rep`, new `prepend_scheme` / `split`), Llama-2 decoder sequences and added tokens
  with every `special` / `normalized` flag (tests/helpers/built_tokenizers.py). The
  oracle is `Tokenizer.decode`, or transformers' decode with reference="transformers".
- SentencePiece byte-fallback models from sentencepiece's trainer, in prompt context
  with the prompt cut inside a character, read as a file and through a ChatGLM3-shaped
  Python wrapper (specials past the model's ids, runs decoded by sentencepiece).
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.built_tokenizers import ADDED, TEXTS, WORDS, Build, build, grid
from tests.helpers.env import require
from tokentrail import Aligner

SETTINGS = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _stream(a: Aligner, ids: Sequence[int]) -> str:
    out = [s.text for i in ids for s in a.push(i)]
    return "".join(out) + "".join(s.text for s in a.finish())


def _in_context(a: Aligner, ids: Sequence[int], cut: int) -> str:
    """prompt_text + the continuation's text, with ids[:cut] as the prompt."""
    b = a.fresh(list(ids[:cut]))
    return b.prompt_text + _stream(b, ids[cut:])


def _ids(data: st.DataObject, words: list[list[int]], marks: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(data.draw(st.integers(0, 6))):
        kind = data.draw(st.sampled_from(["word", "mark", "mark", "any"]))
        if kind == "word":
            out += data.draw(st.sampled_from(words))
        elif kind == "mark":
            out.append(data.draw(st.sampled_from(marks)))
        else:
            out.append(data.draw(st.integers(0, n - 1)))
    return out


# -- tokenizer.json: the grid -------------------------------------------------------------


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Build], Path]:
    root = tmp_path_factory.mktemp("built")
    made: dict[str, Path] = {}

    def get(b: Build) -> Path:
        if b.key not in made:
            made[b.key] = build(b, root / b.key)
        return made[b.key]

    return get


def _parts(tok: Any) -> tuple[list[list[int]], list[int], int]:
    words = [tok.encode(w, add_special_tokens=False).ids for w in WORDS]
    marks = [tok.token_to_id(a[0]) for a in ADDED]
    return [w for w in words if w], marks, tok.get_vocab_size(with_added_tokens=True)


@pytest.mark.parametrize("b", grid(), ids=lambda b: b.key)
@SETTINGS
@given(data=st.data())
def test_built_tokenizer_json_decodes_as_tokenizers(
    builds: Callable[[Build], Path], b: Build, data: st.DataObject
) -> None:
    from tokenizers import Tokenizer

    path = builds(b)
    tok = Tokenizer.from_file(str(path))
    ids = _ids(data, *_parts(tok))
    cut = data.draw(st.integers(0, len(ids)))
    for skip in (False, True):
        want = tok.decode(ids, skip_special_tokens=skip)
        a = Aligner(str(path), skip_special_tokens=skip)
        assert _stream(a, ids) == want, (skip, [tok.id_to_token(i) for i in ids])
        assert _in_context(a, ids, cut) == want, (skip, cut, [tok.id_to_token(i) for i in ids])


def _legacy_llama(builds: Callable[[Build], Path]) -> tuple[Path, Any]:
    from tokenizers import Tokenizer

    path = builds(Build("bpe", "llama-legacy", "llama2"))
    return path, Tokenizer.from_file(str(path))


def test_normalized_added_token_gets_the_space_its_normalizer_gives(
    builds: Callable[[Build], Path],
) -> None:
    """Family 1: Llama 2's legacy normalizer (Prepend "▁", Replace " " -> "▁") with an
    added token flagged `normalized`. tokenizers >= 0.23 decodes the normalized form
    `▁<plain>`, so the Replace decoder puts a space before the token."""
    path, tok = _legacy_llama(builds)
    words = tok.encode("Hello world", add_special_tokens=False).ids
    plain, raw = tok.token_to_id("<plain>"), tok.token_to_id("<plain_raw>")
    ids = [*words, plain, *words, raw, plain, plain]
    want = tok.decode(ids)
    forms = {tok.normalizer.normalize_str("<plain>"), "<plain>"}
    assert any(f"world{f.replace('▁', ' ')}" in want for f in forms)  # one of the two rules
    for skip in (False, True):
        a = Aligner(str(path), skip_special_tokens=skip)
        assert _stream(a, ids) == tok.decode(ids, skip_special_tokens=skip)
        for cut in range(len(ids) + 1):
            assert _in_context(a, ids, cut) == tok.decode(ids, skip_special_tokens=skip)


def test_skip_drops_what_tokenizers_drops(builds: Callable[[Build], Path]) -> None:
    """Family 2: skip_special_tokens drops a token only where tokenizers does: a special
    `normalized` token whose normalized form is not a special content stays, and a token
    that is not flagged special stays whatever its name."""
    path, tok = _legacy_llama(builds)
    a = Aligner(str(path), skip_special_tokens=True)
    for content, _special, _normalized in ADDED:
        i = tok.token_to_id(content)
        kept = tok.decode([i, i], skip_special_tokens=True) != ""  # the oracle's answer
        assert (i in a.vocab.special) != kept, content


@pytest.mark.parametrize("unk_special", [True, False])
def test_unk_flag_decides_under_tokenizers(
    builds: Callable[[Build], Path], unk_special: bool
) -> None:
    from tokenizers import Tokenizer

    path = builds(Build("bpe", "none", "llama2", unk_special=unk_special))
    tok = Tokenizer.from_file(str(path))
    unk = tok.token_to_id("<unk>")
    words = tok.encode("Hello world", add_special_tokens=False).ids
    for ids in ([unk, *words], [*words, unk, *words], [*words, unk, unk]):
        want = tok.decode(ids, skip_special_tokens=True)
        assert ("<unk>" in want) == (not unk_special)  # the oracle follows the file's flag
        assert _stream(Aligner(str(path), skip_special_tokens=True), ids) == want


@pytest.fixture(scope="module")
def llama2_legacy(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama 2's real vocabulary in the layout of its published tokenizer.json (normalizer
    Prepend "▁" + Replace " " -> "▁", no pre-tokenizer, Replace/ByteFallback/Fuse/Strip
    decoder), with tokens added the way chat fine-tunes add them: `add_tokens` (normalized)
    and `add_special_tokens` with `normalized=True`."""
    from tokenizers import AddedToken, Tokenizer

    from tests.helpers.tokenizer_specs import converted

    require("transformers")
    model = corpus / "tokenizers/llama2/tokenizer.model"
    if not model.is_file():
        pytest.skip(f"{model} missing from the corpus")
    spec = json.loads((converted(str(model)) / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    spec["pre_tokenizer"] = None
    out = tmp_path_factory.mktemp("llama2-legacy") / "tokenizer.json"
    out.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    tok = Tokenizer.from_file(str(out))
    tok.add_tokens(["<|im_start|>", "<|im_end|>", AddedToken("<pad>", normalized=True)])
    tok.add_special_tokens([AddedToken("<|tool|>", special=True, normalized=True)])
    tok.save(str(out))
    return out


@pytest.mark.corpus
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_llama2_legacy_layout_with_added_tokens(llama2_legacy: Path, data: st.DataObject) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(llama2_legacy))
    words = [
        tok.encode(t, add_special_tokens=False).ids
        for t in ("Hello", " world", "user\n", "你好", "🙂", " ", "")
    ]
    marks = [tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<pad>", "<|tool|>")]
    marks += [tok.token_to_id(t) for t in ("<s>", "</s>", "<unk>")]
    ids = _ids(data, [w for w in words if w], marks, tok.get_vocab_size(with_added_tokens=True))
    cut = data.draw(st.integers(0, len(ids)))
    for skip in (False, True):
        want = tok.decode(ids, skip_special_tokens=skip)
        a = _aligner(llama2_legacy, skip).fresh(None)
        assert _stream(a, ids) == want, (skip, [tok.id_to_token(i) for i in ids])
        assert _in_context(a, ids, cut) == want, (skip, cut)


@functools.cache
def _aligner(path: Path, skip: bool) -> Aligner:
    return Aligner(str(path), skip_special_tokens=skip)


# -- reference="transformers" on tokenizer.json -------------------------------------------

CONFIGS: dict[str, dict[str, Any] | None] = {
    "no-config": None,
    "fast": {"tokenizer_class": "PreTrainedTokenizerFast"},
    "llama-legacy": {
        "tokenizer_class": "LlamaTokenizerFast",
        "legacy": True,
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
    },
    "llama-non-legacy": {
        "tokenizer_class": "LlamaTokenizerFast",
        "legacy": False,
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
    },
    # tokenizer_config.json's added_tokens_decoder flags every added token the other way
    "flags-disagree": {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"},
}


def _with_config(path: Path, name: str) -> None:
    cfg = CONFIGS[name]
    if cfg is None:
        return
    cfg = dict(cfg)
    if name == "flags-disagree":
        spec = json.loads(path.read_text(encoding="utf-8"))
        keys = ("content", "lstrip", "rstrip", "normalized", "single_word")
        cfg["added_tokens_decoder"] = {
            str(t["id"]): {**{k: t[k] for k in keys}, "special": not t["special"]}
            for t in spec["added_tokens"]
        }
    (path.parent / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize(
    "b",
    [Build("bpe", "llama-legacy", "llama2"), Build("bpe", "none", "metaspace-legacy-true")],
    ids=lambda b: b.key,
)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_transformers_reference_follows_transformers(
    tmp_path_factory: pytest.TempPathFactory, b: Build, config: str, data: st.DataObject
) -> None:
    """transformers may decode a folder otherwise than its tokenizer.json (its class
    rebuilds the decoder, its config names and flags the specials); with
    reference="transformers" the text is transformers' decode."""
    transformers = require("transformers")
    path = _built_with_config(tmp_path_factory, b, config)
    tf = transformers.AutoTokenizer.from_pretrained(str(path.parent), local_files_only=True)
    ids = _ids(data, *_parts(tf.backend_tokenizer))
    for skip in (False, True):
        want = tf.decode(ids, skip_special_tokens=skip)
        for src in (path.parent, path):
            a = Aligner(str(src), skip_special_tokens=skip, reference="transformers")
            assert _stream(a, ids) == want, (src.name, skip, tf.convert_ids_to_tokens(ids))


_CONFIGURED: dict[tuple[str, str], Path] = {}


def _built_with_config(factory: pytest.TempPathFactory, b: Build, config: str) -> Path:
    key = (b.key, config)
    if key not in _CONFIGURED:
        path = build(b, factory.mktemp(f"{b.key}-{config}"))
        _with_config(path, config)
        _CONFIGURED[key] = path
    return _CONFIGURED[key]


# -- SentencePiece: prompts that end inside a character -----------------------------------

SPM_OPTIONS = [
    ("bpe", True, False),
    ("bpe", False, False),
    ("unigram", True, True),
    ("unigram", False, False),
]


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool, bool], Path]:
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("spm")
    out = {}
    for kind, dummy, extra in SPM_OPTIONS:
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(TEXTS * 20),
            model_writer=buf,
            vocab_size=400,
            hard_vocab_limit=False,
            model_type=kind,
            byte_fallback=True,
            character_coverage=0.99,
            normalization_rule_name="identity",
            add_dummy_prefix=dummy,
            remove_extra_whitespaces=extra,
            minloglevel=3,
        )
        path = root / f"{kind}-{dummy}-{extra}.model"
        path.write_bytes(buf.getvalue())
        out[(kind, dummy, extra)] = path
    return out


def _spm_ids(data: st.DataObject, sp: Any, n: int) -> list[int]:
    """Words, characters spelt as byte pieces (often cut short), and any id."""
    byte_id = {b: sp.piece_to_id(f"<0x{b:02X}>") for b in range(256)}
    words = [sp.encode(t) for t in ("你好", " 中文", "Hello", " world", "🙂", "  x", "\n")]
    out: list[int] = []
    for _ in range(data.draw(st.integers(1, 6))):
        kind = data.draw(st.sampled_from(["word", "bytes", "bytes", "any"]))
        if kind == "word":
            out += data.draw(st.sampled_from(words))
        elif kind == "bytes":
            raw = data.draw(st.sampled_from("中é🙂好")).encode("utf-8")
            out += [byte_id[b] for b in raw[: data.draw(st.integers(1, len(raw)))]]
        else:
            out.append(data.draw(st.integers(0, n - 1)))
    return out


class GLMLike:
    """The shape of ChatGLM3's tokenizer (its SPTokenizer under a transformers class):
    special tokens numbered past the sentencepiece model, each run of model ids decoded
    by sentencepiece, a special as its name. Loaded by tokentrail as a Python-side
    tokenizer (the generic path)."""

    SPECIALS = ("[MASK]", "[gMASK]", "sop", "<|user|>", "<|assistant|>")

    def __init__(self, path: Path) -> None:
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.n = self.sp.get_piece_size()
        self.all_special_ids = list(range(self.n, self.n + len(self.SPECIALS)))

    def __len__(self) -> int:
        return self.n + len(self.SPECIALS)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.SPECIALS[i - self.n] if i >= self.n else self.sp.id_to_piece(i) for i in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text, run = "", []
        for i in ids:
            if i < self.n:
                run.append(i)
                continue
            text += self.sp.decode(run) if run else ""
            run = []
            text += "" if skip_special_tokens else self.SPECIALS[i - self.n]
        return text + (self.sp.decode(run) if run else "")


@pytest.mark.parametrize("opts", SPM_OPTIONS, ids=lambda o: "-".join(map(str, o)))
@SETTINGS
@given(data=st.data())
def test_spm_prompt_cut_inside_a_character(
    spm_models: dict[tuple[str, bool, bool], Path], opts: tuple[str, bool, bool], data
) -> None:
    """Family 4 in general form: prompt_text + continuation == decode(prompt + reply) for
    every cut, including cuts between the byte pieces of one character."""
    import sentencepiece as spm

    path = spm_models[opts]
    sp = spm.SentencePieceProcessor(model_file=str(path))
    ids = _spm_ids(data, sp, sp.get_piece_size())
    want = sp.decode(ids)
    a = Aligner(str(path))
    assert _stream(a, ids) == want
    for cut in range(len(ids) + 1):
        assert _in_context(a, ids, cut) == want, (cut, [sp.id_to_piece(i) for i in ids])


@pytest.mark.parametrize("opts", SPM_OPTIONS[:3], ids=lambda o: "-".join(map(str, o)))
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_chatglm_shaped_wrapper_in_context(
    spm_models: dict[tuple[str, bool, bool], Path], opts: tuple[str, bool, bool], data
) -> None:
    tok = GLMLike(spm_models[opts])
    ids = _spm_ids(data, tok.sp, len(tok))
    for _ in range(data.draw(st.integers(0, 2))):
        ids.insert(
            data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from(tok.all_special_ids))
        )
    for skip in (False, True):
        want = tok.decode(ids, skip)
        a = Aligner(tok, skip_special_tokens=skip)
        for cut in range(len(ids) + 1):
            assert _in_context(a, ids, cut) == want, (skip, cut, tok.convert_ids_to_tokens(ids))
