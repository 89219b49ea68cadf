"""`vocab.json + merges.txt` folders, and folders defined by a transformers class.

A byte-level BPE folder (GPT-2, RoBERTa, BART, Qwen2 style) is rebuilt as a tokenizers
BPE with the ByteLevel decoder; its special tokens are the ones tokenizer_config.json
names plus the class defaults that no file states (`default_specials`). Folders whose
class shifts ids or adds tokens (XLM-R's fairseq offset, BERT's `vocab.txt`) are
compiled through transformers itself (`THROUGH_TRANSFORMERS`).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

from .core import TokenizerLoadError, Vocab, read_json
from .hf_objects import vocab_from_transformers

#: Special tokens that transformers' tokenizer classes for vocab.json + merges.txt
#: folders have by default (their constructors' defaults), named by no file: RoBERTa's
#: and BART's five (`RobertaTokenizer`, `BartTokenizer` and their kin) and GPT-2's one.
ROBERTA_DEFAULTS = ("<s>", "</s>", "<unk>", "<pad>", "<mask>")

GPT2_DEFAULTS = ("<|endoftext|>",)

CLASS_DEFAULTS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("roberta", "bart", "longformer", "led", "mvp", "blenderbot"), ROBERTA_DEFAULTS
    ),
    **dict.fromkeys(("gpt2", "gptneo", "gptj", "codegen"), GPT2_DEFAULTS),
}


def tokenizer_family(path: Path, cfg: dict[str, Any] | None) -> str | None:
    """The tokenizer class a folder's config names, as a lower-case family name.

    `tokenizer_config.json`'s `tokenizer_class` ("XLMRobertaTokenizerFast" ->
    "xlmroberta") wins over `config.json`'s `model_type` ("xlm-roberta" -> "xlmroberta").
    """
    name = (cfg or {}).get("tokenizer_class")
    if isinstance(name, str) and name:
        return re.sub(r"[^a-z0-9]", "", re.sub(r"(Tokenizer)?(Fast)?$", "", name).lower())
    model = (read_json(path / "config.json") or {}).get("model_type")
    return re.sub(r"[^a-z0-9]", "", model.lower()) if isinstance(model, str) and model else None


def default_specials(family: str | None, vocab: dict[str, int]) -> tuple[str, ...]:
    """The class-default special tokens of a vocab.json + merges.txt folder.

    With a class named in the folder's config, its defaults (`CLASS_DEFAULTS`). With
    none (transformers cannot load such a folder at all) the rule here is: RoBERTa's
    five when vocab.json holds `<s>` and `</s>`, else GPT-2's `<|endoftext|>`.
    """
    if family is not None:
        return CLASS_DEFAULTS.get(family, ())
    if "<s>" in vocab and "</s>" in vocab:
        return ROBERTA_DEFAULTS
    return GPT2_DEFAULTS


#: Tokenizer classes whose ids or special tokens are not their files' own, compiled
#: through transformers itself when no tokenizer.json states them: XLM-R, CamemBERT,
#: mBART, NLLB, XGLM, BARThez and PLBart shift the sentencepiece ids by fairseq's offset
#: and add `<s>`/`<pad>`/`</s>`/`<unk>`/`<mask>` (and language codes) around them;
#: BERT-style `vocab.txt` folders get the class's `[CLS]`/`[SEP]`/`[PAD]`/`[UNK]`/`[MASK]`,
#: lower-casing and WordPiece decode.
THROUGH_TRANSFORMERS = frozenset(
    {
        "xlmroberta", "camembert", "mbart", "mbart50", "nllb", "xglm", "barthez", "plbart",
        "bert", "distilbert", "electra", "squeezebert", "mobilebert", "funnel", "layoutlm",
    }
)  # fmt: skip


def via_transformers(path: Path, family: str) -> Vocab:
    """A folder whose tokenizer class adds what no file states, through transformers."""

    if importlib.util.find_spec("transformers") is None:
        what = (
            "decoding it as transformers does (reference='transformers')"
            if family == "tokenizer.json"
            else f"a {family} tokenizer folder without tokenizer.json is defined by its "
            "transformers class (ids, special tokens); reading it"
        )
        raise TokenizerLoadError(
            f"{path}: {what} needs transformers (pip install 'tokentrail[hf]')"
        )
    from transformers import AutoTokenizer, BertTokenizer, PreTrainedTokenizerFast

    try:
        if (path / "config.json").is_file() or (path / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        elif (path / "tokenizer.json").is_file():  # no config: the file's own class
            tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
        else:  # a bare vocab.txt: BERT's class, as transformers' own examples load it
            tok = BertTokenizer(vocab_file=str(path / "vocab.txt"))
    except Exception as e:  # transformers raises ValueError/OSError/KeyError
        raise TokenizerLoadError(f"{path}: transformers cannot load this folder: {e}") from e
    v = vocab_from_transformers(tok)
    v.name = f"{path} ({type(tok).__name__})"
    return v


def bpe_from_files(path: Path, cfg: dict[str, Any] | None) -> Any:
    """A byte-level BPE tokenizers.Tokenizer from vocab.json + merges.txt + added tokens.

    The special tokens are the ones tokenizer_config.json names (its added tokens and
    bos/eos/unk/pad/mask) and the class defaults (`default_specials`) that vocab.json
    holds; they are marked special added tokens, so skip_special_tokens drops them.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
    merges = []
    for line in (path / "merges.txt").read_text(encoding="utf-8").splitlines():
        if not line or line.startswith("#version"):
            continue
        a, _, b = line.partition(" ")
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    added: dict[int, tuple[str, bool]] = {}
    extra = read_json(path / "added_tokens.json") or {}
    for content, i in extra.items():
        added[int(i)] = (content, False)
    for i, spec in ((cfg or {}).get("added_tokens_decoder") or {}).items():
        added[int(i)] = (spec["content"], bool(spec.get("special", False)))
    specials = set(default_specials(tokenizer_family(path, cfg), vocab))
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token"):
        value = (cfg or {}).get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            specials.add(value)
    inside = [c for c in sorted(specials) if c in vocab]  # already have their ids
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in inside])
    for i in sorted(added):
        content, special = added[i]
        if content in vocab:
            continue
        token = AddedToken(content, special=special or content in specials, normalized=False)
        tok.add_tokens([token]) if not token.special else tok.add_special_tokens([token])
        if tok.token_to_id(content) != i:
            raise TokenizerLoadError(
                f"{path}: added token {content!r} expected at id {i}, "
                f"got {tok.token_to_id(content)}"
            )
    return tok
