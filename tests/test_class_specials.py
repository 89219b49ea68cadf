"""Special tokens that a tokenizer class adds by default, which no file of its folder states.

The oracle is transformers itself, on folders built here in temporary directories from
corpus data (no network):

- RoBERTa/BART-style `vocab.json + merges.txt` folders (GPT-2's corpus vocabulary with
  `<s>`, `<pad>`, `</s>`, `<unk>` first and `<mask>` last, as RoBERTa's vocab.json has
  them), the class named by config.json's `model_type` or tokenizer_config.json's
  `tokenizer_class`; a real GPT-2 folder (`<|endoftext|>`).
- XLM-R-style folders (a sentencepiece model and `model_type: xlm-roberta`): the class
  shifts every id by fairseq's offset and adds five special tokens.
- BERT-style `vocab.txt` folders (a WordPiece vocabulary trained here with tokenizers).
- GGUF files whose EOS/BOS/PAD are user-defined `</s>`/`<s>`/`<pad>`, with
  reference="transformers": skipped exactly when transformers' GGUF tokenizer skips them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.env import corpus_path, require
from tests.helpers.gguf_files import finish, vocab_writer
from tokentrail import Aligner, TokenizerLoadError, load_vocab

transformers = pytest.importorskip("transformers", reason="transformers is the oracle here")

TEXTS = ["Hello, world! don't stop", "naïve café 你好 🙂", "  two  spaces\nand a line"]


def _gpt2_parts() -> tuple[dict[str, int], list[str]]:
    spec = json.loads(corpus_path("tokenizers", "gpt2", "tokenizer.json").read_text("utf-8"))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return spec["model"]["vocab"], merges


def _write_bpe_folder(folder: Path, vocab: dict[str, int], merges: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), "utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", "utf-8")
    return folder


def _roberta_vocab() -> tuple[dict[str, int], list[str]]:
    gpt2, merges = _gpt2_parts()
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for token, _ in sorted(gpt2.items(), key=lambda kv: kv[1]):
        if token != "<|endoftext|>":
            vocab[token] = len(vocab)
    vocab["<mask>"] = len(vocab)
    return vocab, merges


CONFIGS = {
    "roberta-model-type": ("config.json", {"model_type": "roberta"}),
    "bart-model-type": ("config.json", {"model_type": "bart"}),
    "roberta-class": ("tokenizer_config.json", {"tokenizer_class": "RobertaTokenizerFast"}),
    "bart-class": ("tokenizer_config.json", {"tokenizer_class": "BartTokenizer"}),
}


@pytest.fixture(scope="module")
def roberta_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    vocab, merges = _roberta_vocab()
    out = {}
    for key, (name, cfg) in CONFIGS.items():
        folder = _write_bpe_folder(tmp_path_factory.mktemp(key), vocab, merges)
        (folder / name).write_text(json.dumps(cfg), "utf-8")
        out[key] = folder
    out["no-config"] = _write_bpe_folder(tmp_path_factory.mktemp("bare"), vocab, merges)
    return out


def _same_as_transformers(folder: Path, ids: list[int], tok=None) -> None:
    tok = tok or transformers.AutoTokenizer.from_pretrained(str(folder))
    for skip in (False, True):
        text = "".join(s.text for s in Aligner(folder, skip_special_tokens=skip).align(ids))
        assert text == tok.decode(ids, skip_special_tokens=skip), (skip, ids)


@pytest.mark.parametrize("key", list(CONFIGS))
def test_roberta_style_folder_skips_the_class_defaults(roberta_folders, key: str) -> None:
    folder = roberta_folders[key]
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    v = load_vocab(folder)
    assert {tok.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<unk>", "<pad>", "<mask>")} \
        == set(v.special)  # fmt: skip
    for text in TEXTS:
        ids = tok(text).input_ids  # <s> ... </s>, as the class adds them
        _same_as_transformers(folder, [*ids, 1, 1, v.size - 1, 3], tok)
    assert "".join(s.text for s in Aligner(folder, skip_special_tokens=True).align(
        [0, *tok(" Hi", add_special_tokens=False).input_ids, 2, 1]
    )) == " Hi"  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_roberta_style_random_ids(roberta_folders, data: st.DataObject) -> None:
    folder = roberta_folders["roberta-model-type"]
    tok = _tok(folder)
    n = len(tok)
    ids = data.draw(
        st.lists(st.one_of(st.integers(0, n - 1), st.sampled_from([0, 1, 2, 3, n - 1])))
    )
    _same_as_transformers(folder, ids, tok)


_TOKS: dict[Path, object] = {}


def _tok(folder: Path):
    if folder not in _TOKS:
        _TOKS[folder] = transformers.AutoTokenizer.from_pretrained(str(folder))
    return _TOKS[folder]


def test_roberta_style_folder_without_config_follows_the_documented_rule(roberta_folders):
    """transformers cannot load a folder naming no class; the rule here (documented in
    `default_specials`) takes RoBERTa's five when vocab.json holds <s> and </s>, which is
    what the RoBERTa class does with the same files."""
    bare, named = roberta_folders["no-config"], roberta_folders["roberta-model-type"]
    with pytest.raises(ValueError):
        transformers.AutoTokenizer.from_pretrained(str(bare))
    assert load_vocab(bare).special == load_vocab(named).special
    _same_as_transformers(bare, [0, 31414, 232, 2, 1, 3], _tok(named))


def test_gpt2_folder_skips_endoftext(tmp_path: Path) -> None:
    vocab, merges = _gpt2_parts()
    folder = _write_bpe_folder(tmp_path / "gpt2", vocab, merges)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}), "utf-8")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    eot = vocab["<|endoftext|>"]
    assert load_vocab(folder).special == {eot}
    _same_as_transformers(folder, [eot, *tok("Hello world").input_ids, eot], tok)


def test_xlm_roberta_folder_has_the_fairseq_ids(tmp_path: Path) -> None:
    """XLM-R's class puts <s> <pad> </s> <unk> at 0-3, every sentencepiece id one up and
    <mask> last: a folder naming the class is compiled through transformers."""
    folder = tmp_path / "xlmr"
    folder.mkdir()
    (folder / "sentencepiece.bpe.model").symlink_to(corpus_path("tokenizers", "t5", "spiece.model"))
    (folder / "config.json").write_text(json.dumps({"model_type": "xlm-roberta"}), "utf-8")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    v = load_vocab(folder)
    assert v.size == len(tok) and {0, 1, 2, 3, len(tok) - 1} <= v.special
    for text in TEXTS:
        ids = tok(text).input_ids
        _same_as_transformers(folder, [*ids, 1, len(tok) - 1], tok)


def test_bert_vocab_txt_folder(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from tokenizers.trainers import WordPieceTrainer

    trained = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    trained.normalizer = normalizers.BertNormalizer(lowercase=True)
    trained.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trained.train_from_iterator(
        TEXTS * 20, WordPieceTrainer(vocab_size=300, special_tokens=specials)
    )
    folder = tmp_path / "bert"
    folder.mkdir()
    trained.model.save(str(folder))  # vocab.txt
    bare = transformers.BertTokenizer(vocab_file=str(folder / "vocab.txt"))
    for text in TEXTS:
        ids = bare(text).input_ids  # [CLS] ... [SEP]
        _same_as_transformers(folder, [*ids, 0, 4], bare)
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}), "utf-8")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    _same_as_transformers(folder, tok("Hello, world! don't stop").input_ids, tok)


def test_class_folders_without_transformers_name_the_extra(tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    folder = tmp_path / "xlmr"
    folder.mkdir()
    (folder / "sentencepiece.bpe.model").symlink_to(corpus_path("tokenizers", "t5", "spiece.model"))
    (folder / "config.json").write_text(json.dumps({"model_type": "xlm-roberta"}), "utf-8")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )
    with pytest.raises(TokenizerLoadError, match=r"pip install 'tokentrail\[hf\]'"):
        load_vocab(folder)


def _gguf_with_user_defined_specials(path: Path, named: bool) -> tuple[Path, int]:
    """The demo model's byte-level BPE as a GGUF, plus user-defined </s> <s> <pad>,
    named as EOS/BOS/PAD by the metadata when `named`."""
    from tokentrail.generate import DEMO_MODEL

    spec = json.loads((DEMO_MODEL / "tokenizer.json").read_text("utf-8"))
    tokens = [""] * len(spec["model"]["vocab"])
    for t, i in spec["model"]["vocab"].items():
        tokens[i] = t
    types = [1] * len(tokens)
    for added in spec.get("added_tokens", []):
        types[added["id"]] = 3 if added.get("special") else 4
    n = len(tokens)
    w = vocab_writer(path, "gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([*tokens, "</s>", "<s>", "<pad>"])
    w.add_token_types([*types, 4, 4, 4])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    if named:
        w.add_eos_token_id(n)
        w.add_bos_token_id(n + 1)
        w.add_pad_token_id(n + 2)
    else:
        w.add_eos_token_id(0)
        w.add_bos_token_id(0)
    finish(w)
    return path, n


@pytest.mark.parametrize("named", [True, False], ids=["named-eos", "unnamed"])
def test_gguf_user_defined_eos_follows_transformers(tmp_path: Path, named: bool) -> None:
    require("gguf")
    require("torch")
    path, n = _gguf_with_user_defined_specials(tmp_path / "ud.gguf", named)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ids = [n + 1, 50, 60, n, n + 2, 0, 70]
    for skip in (False, True):
        a = Aligner(path, skip_special_tokens=skip, reference="transformers")
        text = "".join(s.text for s in a.align(ids))
        assert text == tok.decode(ids, skip_special_tokens=skip)
