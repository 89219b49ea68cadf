"""Decode rules read from a format's metadata, each checked against that format's library.

- A tiktoken rank file of an encoding in tiktoken's registry is recognised by its hash
  (as tiktoken checks it) and gets the registry's special tokens, offline. The oracle is
  `tiktoken.get_encoding(name)`, reading the same file through tiktoken's own cache.
- A token's `special` flag decides what skip_special_tokens drops, as the library that
  loaded the file decides it: `tokenizers` follows the tokenizer.json flag; transformers
  also drops the tokens its config names (bos/eos/unk), whatever the flag says.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.env import require
from tokentrail import Aligner

R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"


def _text(a: Aligner, ids: list[int]) -> str:
    out = []
    for i in ids:
        out.extend(s.text for s in a.push(i))
    out.extend(s.text for s in a.finish())
    return "".join(out)


# -- tiktoken: a registered encoding's file ------------------------------------------------


@pytest.fixture(scope="module")
def r50k(corpus: Path) -> Path:
    path = corpus / "tokenizers/gpt2/gpt2.tiktoken"
    if not path.is_file():
        pytest.skip(f"{path} missing from the corpus")
    return path


@pytest.fixture
def registry_encoding(r50k: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """tiktoken.get_encoding('r50k_base') as tiktoken builds it offline: the file in its
    cache folder under the name it gives the URL (tiktoken/load.py, read_file_cached)."""
    require("tiktoken")
    import tiktoken.registry

    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    (cache / hashlib.sha1(R50K_URL.encode()).hexdigest()).write_bytes(r50k.read_bytes())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "r50k_base", raising=False)
    return tiktoken.get_encoding("r50k_base")


def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiktoken.load

    def refuse(blobpath: str) -> bytes:
        raise AssertionError(f"tried to fetch {blobpath}")

    monkeypatch.setattr(tiktoken.load, "read_file", refuse)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no cache either: only the file itself


@pytest.mark.corpus
def test_registered_rank_file_gets_the_registry_specials(
    r50k: Path, registry_encoding, monkeypatch: pytest.MonkeyPatch
) -> None:
    enc = registry_encoding
    _no_network(monkeypatch)
    a = Aligner(str(r50k))
    v = a.vocab
    assert v.source.name == "r50k_base"
    assert v.size == enc.n_vocab
    specials = {enc.encode_single_token(s) for s in enc.special_tokens_set}
    assert v.special == specials
    for s in enc.special_tokens_set:
        assert v.token_bytes(enc.encode_single_token(s)) == s.encode()


@pytest.mark.corpus
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_registered_rank_file_decodes_as_tiktoken(
    r50k: Path, registry_encoding, data: st.DataObject
) -> None:
    enc = registry_encoding
    specials = sorted(enc.encode_single_token(s) for s in enc.special_tokens_set)
    text = data.draw(st.sampled_from(["Hello world", "café 🙂 你好", " a\n\tb", ""]))
    ids = enc.encode(text)
    for _ in range(data.draw(st.integers(1, 3))):
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from(specials)))
    ids += data.draw(st.lists(st.integers(0, enc.n_vocab - 1), max_size=4))
    for skip in (False, True):
        kept = [i for i in ids if not (skip and i in specials)]
        assert _text(Aligner(str(r50k), skip_special_tokens=skip), ids) == enc.decode(kept)


@pytest.mark.corpus
def test_other_rank_file_is_not_taken_for_a_registered_one(
    r50k: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank line fewer: another hash, so not r50k_base (and no special tokens)."""
    require("tiktoken")
    _no_network(monkeypatch)
    lines = r50k.read_bytes().splitlines(keepends=True)
    other = tmp_path / "other.tiktoken"
    other.write_bytes(b"".join(lines[:-1]))
    v = Aligner(str(other)).vocab
    assert "r50k_base" not in v.name
    assert v.size == len(lines) - 1 and not v.special
    with pytest.raises(ValueError, match="outside the vocabulary"):
        v.check_id(len(lines) - 1)


# -- the special flag ------------------------------------------------------------------------


def _llama2_folder(corpus: Path, tmp: Path, unk_special: bool) -> Path:
    """Llama 2's tokenizer.json (converted by transformers) with `<unk>` flagged as given,
    plus a non-special added token and a special one."""
    transformers = require("transformers")
    from tokenizers import AddedToken, Tokenizer

    model = corpus / "tokenizers/llama2/tokenizer.model"
    if not model.is_file():
        pytest.skip(f"{model} missing from the corpus")
    src, out = tmp / "src", tmp / "hf"
    src.mkdir()
    (src / "tokenizer.model").symlink_to(model)
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken("<plain>", special=False)])
    tok.add_special_tokens([AddedToken("<|tool|>", special=True)])
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        if added["content"] == "<unk>":
            added["special"] = unk_special
    (out / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def unflagged(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _llama2_folder(corpus, tmp_path_factory.mktemp("unflagged"), unk_special=False)


def _cases(tok, seed: int = 0) -> list[list[int]]:
    words = tok.encode("hello world café", add_special_tokens=False).ids
    marks = [tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>", "<plain>", "<|tool|>")]
    rng = random.Random(seed)
    out = [[marks[0], *words], [*words, marks[0]], [marks[1], marks[0], *words]]
    for _ in range(60):
        ids = [rng.choice(words) for _ in range(rng.randint(0, 4))]
        for _ in range(rng.randint(1, 3)):
            ids.insert(rng.randint(0, len(ids)), rng.choice(marks))
        out.append(ids)
    return out


@pytest.mark.corpus
@pytest.mark.parametrize("skip", [False, True], ids=["keep-special", "skip-special"])
@pytest.mark.parametrize("how", ["tokenizer.json", "folder", "Tokenizer"])
def test_unflagged_token_follows_tokenizers(unflagged: Path, how: str, skip: bool) -> None:
    """Through tokenizers, `<unk>` flagged `special: false` stays under skip_special_tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(unflagged / "tokenizer.json"))
    src = {"tokenizer.json": str(unflagged / "tokenizer.json"), "folder": str(unflagged)}
    a = Aligner(src.get(how, tok), skip_special_tokens=skip)
    unk = tok.token_to_id("<unk>")
    assert unk not in a.vocab.special
    if skip:
        assert "<unk>" in tok.decode([unk], skip_special_tokens=True)  # the oracle keeps it
    for ids in _cases(tok):
        assert _text(a.fresh(None), ids) == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.corpus
@pytest.mark.parametrize("skip", [False, True], ids=["keep-special", "skip-special"])
def test_unflagged_token_follows_transformers(unflagged: Path, skip: bool) -> None:
    """transformers loads the same folder and drops the `<unk>` its config names: a
    transformers object aligns to transformers' decode, not to the file's flag."""
    transformers = require("transformers")
    tf = transformers.AutoTokenizer.from_pretrained(str(unflagged))
    a = Aligner(tf, skip_special_tokens=skip)
    unk = tf.convert_tokens_to_ids("<unk>")
    assert (unk in a.vocab.special) == (tf.decode([unk], skip_special_tokens=True) == "")
    for ids in _cases(tf.backend_tokenizer, seed=1):
        assert _text(a.fresh(None), ids) == tf.decode(ids, skip_special_tokens=skip), ids
