"""Adapters: build a `Vocab` from any supported tokenizer object or file.

Formats are detected from content, not only from file names: a JSON object with a
`model` key is a Hugging Face tokenizer.json, a file starting with `GGUF` is a GGUF
vocabulary, lines of `base64 rank` are tiktoken ranks, and anything sentencepiece can
parse is a SentencePiece model.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .vocab import Vocab, byte_level_alphabet, wordpiece_cleanup

log = logging.getLogger(__name__)

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/=]+ \d+$")


class TokenizerLoadError(ValueError):
    """The tokenizer could not be recognised or read."""


REFERENCES = ("auto", "llama.cpp", "transformers")


def check_reference(reference: str, fmt: str, where: object, allowed: tuple[str, ...]) -> None:
    """Raise a ValueError when `reference` does not apply to this tokenizer format.

    `allowed` lists the references besides "auto" that the format has: "llama.cpp" only
    for GGUF files, "transformers" for GGUF files and Hugging Face tokenizers (whose
    "auto" reference is transformers' decode already).
    """
    if reference not in REFERENCES:
        raise ValueError(
            f"reference must be one of {', '.join(map(repr, REFERENCES))}, got {reference!r}"
        )
    if reference != "auto" and reference not in allowed:
        choices = ", ".join(repr(r) for r in ("auto", *allowed))
        raise ValueError(
            f"reference={reference!r} does not apply to {where} ({fmt}); "
            f"this format's references are {choices}"
        )


def load_vocab(tokenizer: Any, reference: str = "auto") -> Vocab:
    """Compile a tokenizer object, or a path to tokenizer files, into a `Vocab`.

    `reference` chooses whose decode the text equals: "auto" is the format's own library
    (tokenizers for tokenizer.json, sentencepiece, tiktoken, mistral-common, transformers
    for transformers objects) and llama.cpp for GGUF files; "llama.cpp" and
    "transformers" choose for GGUF files (see `vocab_from_gguf`). A reference that does
    not apply to the format is a ValueError.

    An object with a `__tokentrail_vocab__()` method (an engine's own tokenizer, such
    as llama.cpp's) compiles itself: that method returns its `Vocab`.
    """
    check_reference(reference, "", "", REFERENCES)  # the value itself
    if isinstance(tokenizer, str | os.PathLike):
        return _from_path(Path(tokenizer), reference)
    if isinstance(tokenizer, Vocab):
        check_reference(reference, "an already compiled Vocab", tokenizer.name, ())
        return tokenizer
    mod = type(tokenizer).__module__
    name = type(tokenizer).__name__
    is_transformers = hasattr(tokenizer, "convert_ids_to_tokens") and hasattr(tokenizer, "decode")
    fmt = f"a {mod}.{name} object"
    check_reference(reference, fmt, "the tokenizer", ("transformers",) if is_transformers else ())
    hook = getattr(type(tokenizer), "__tokentrail_vocab__", None)
    if hook is not None:
        vocab = hook(tokenizer)
        if not isinstance(vocab, Vocab):
            raise TokenizerLoadError(
                f"{type(tokenizer).__name__}.__tokentrail_vocab__() returned "
                f"{type(vocab).__name__}, not a tokentrail Vocab"
            )
        return vocab
    if mod.startswith("tokenizers") and name == "Tokenizer":
        return vocab_from_hf_tokenizer(tokenizer)
    if hasattr(tokenizer, "_tokenizer") and mod.startswith("mlx_lm"):
        return load_vocab(tokenizer._tokenizer)  # mlx-lm TokenizerWrapper
    if mod.startswith("sentencepiece"):
        return vocab_from_sentencepiece(tokenizer)
    if mod.startswith("tiktoken") or (hasattr(tokenizer, "_mergeable_ranks")):
        return vocab_from_tiktoken(tokenizer)
    if mod.startswith("mistral_common"):
        from .formats import vocab_from_tekken

        return vocab_from_tekken(tokenizer)
    if hasattr(tokenizer, "convert_ids_to_tokens") and hasattr(tokenizer, "decode"):
        return vocab_from_transformers(tokenizer)
    raise TokenizerLoadError(
        f"unsupported tokenizer object {mod}.{name}: pass a tokenizers.Tokenizer, a "
        "transformers tokenizer, an mlx-lm TokenizerWrapper, a SentencePieceProcessor, "
        "a tiktoken.Encoding, or a path to tokenizer files"
    )


# -- paths -----------------------------------------------------------------------------


_HF = ("transformers",)


def _from_path(path: Path, reference: str = "auto") -> Vocab:
    if not path.exists():
        raise TokenizerLoadError(f"tokenizer path does not exist: {path}")
    if path.is_dir():
        return _from_dir(path, reference)
    try:
        with path.open("rb") as f:
            head = f.read(256)
    except OSError as e:
        raise TokenizerLoadError(f"cannot read tokenizer file {path}: {e}") from e
    if head.startswith(b"GGUF"):
        from .formats import vocab_from_gguf

        return vocab_from_gguf(path, reference=reference)
    stripped = head.lstrip()
    if stripped.startswith(b"{"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenizerLoadError(f"{path} looks like JSON but does not parse: {e}") from e
        return _from_json(path, data, reference)
    first_line = head.split(b"\n", 1)[0].strip()
    if first_line and _TIKTOKEN_LINE.match(first_line):
        check_reference(reference, "tiktoken ranks", path, ())
        return vocab_from_tiktoken_file(path)
    try:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        sp.LoadFromFile(str(path))
    except Exception as e:  # sentencepiece raises plain RuntimeError/OSError
        from .formats import try_llama2c

        v = try_llama2c(path)
        if v is not None:
            check_reference(reference, "a llama2.c tokenizer", path, ())
            return v
        raise TokenizerLoadError(
            f"{path}: not a recognised tokenizer file (tried tokenizer.json, GGUF, "
            f"tiktoken ranks, SentencePiece model, llama2.c tokenizer): {e}"
        ) from e
    check_reference(reference, "a SentencePiece model", path, ())
    return vocab_from_sentencepiece(sp, name=path.name)


def _from_json(path: Path, data: Any, reference: str = "auto") -> Vocab:
    if isinstance(data, dict) and "model" in data and ("decoder" in data or "added_tokens" in data):
        from tokenizers import Tokenizer

        check_reference(reference, "a Hugging Face tokenizer.json", path, _HF)
        tok = Tokenizer.from_file(str(path))
        cfg = None
        if path.name == "tokenizer.json":
            cfg = _read_json(path.parent / "tokenizer_config.json")
        return vocab_from_hf_tokenizer(tok, name=str(path), config=cfg, spec=data)
    if isinstance(data, dict) and "vocab" in data and "config" in data:
        from .formats import vocab_from_tekken

        check_reference(reference, "a Mistral Tekken file", path, ())
        return vocab_from_tekken(path)
    if isinstance(data, dict) and data and all(isinstance(v, int) for v in data.values()):
        return _from_dir(path.parent, reference)  # vocab.json: needs merges.txt beside it
    raise TokenizerLoadError(f"{path}: JSON file is neither a tokenizer.json nor a Tekken file")


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerLoadError(f"cannot read {path}: {e}") from e
    return out if isinstance(out, dict) else None


def _from_dir(path: Path, reference: str = "auto") -> Vocab:
    cfg = _read_json(path / "tokenizer_config.json")
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        check_reference(reference, "a Hugging Face tokenizer folder", path, _HF)
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        return vocab_from_hf_tokenizer(tok, name=str(path), config=cfg)
    family = tokenizer_family(path, cfg)
    if family in THROUGH_TRANSFORMERS or (
        (path / "vocab.txt").is_file() and not (path / "vocab.json").is_file()
    ):
        check_reference(reference, f"a {family or 'bert'} tokenizer folder", path, _HF)
        return _via_transformers(path, family or "bert")
    if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        check_reference(reference, "a vocab.json + merges.txt folder", path, _HF)
        return vocab_from_hf_tokenizer(_bpe_from_files(path, cfg), name=str(path), config=cfg)
    for candidate in ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model"):
        if (path / candidate).is_file():
            return _from_path(path / candidate, reference)
    for candidate in sorted(path.glob("*.tiktoken")) + sorted(path.glob("tekken*.json")):
        return _from_path(candidate, reference)
    raise TokenizerLoadError(
        f"{path}: no tokenizer.json, vocab.json+merges.txt, tokenizer.model, "
        "*.tiktoken or tekken.json found in this folder"
    )


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
    model = (_read_json(path / "config.json") or {}).get("model_type")
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


def _via_transformers(path: Path, family: str) -> Vocab:
    """A folder whose tokenizer class adds what no file states, through transformers."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise TokenizerLoadError(
            f"{path}: a {family} tokenizer folder without tokenizer.json is defined by its "
            "transformers class (ids, special tokens); reading it needs transformers "
            "(pip install 'tokentrail[hf]')"
        )
    from transformers import AutoTokenizer, BertTokenizer

    try:
        if (path / "config.json").is_file() or (path / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        else:  # a bare vocab.txt: BERT's class, as transformers' own examples load it
            tok = BertTokenizer(vocab_file=str(path / "vocab.txt"))
    except Exception as e:  # transformers raises ValueError/OSError/KeyError
        raise TokenizerLoadError(f"{path}: transformers cannot load this folder: {e}") from e
    v = vocab_from_transformers(tok)
    v.name = f"{path} ({type(tok).__name__})"
    return v


def _bpe_from_files(path: Path, cfg: dict[str, Any] | None) -> Any:
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
    extra = _read_json(path / "added_tokens.json") or {}
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


# -- Hugging Face tokenizers -------------------------------------------------------------


def _flatten(decoder: Any) -> list[dict[str, Any]]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        out: list[dict[str, Any]] = []
        for d in decoder.get("decoders", []):
            out.extend(_flatten(d))
        return out
    return [decoder]


class _Unsupported(Exception):
    pass


def _compile_decoder(
    steps: list[dict[str, Any]], tokens: list[str | None]
) -> tuple[list[bytes | None], dict[int, bytes], frozenset[int], str, int]:
    """Simulate a tokenizers decoder pipeline per token.

    Returns (pieces, first_pieces, byte_ids, byte_mode, strip_leading). Raises
    `_Unsupported` for a pipeline whose effect is not per-token plus the known
    whole-text rules, so that the caller can fall back to the generic path.
    """
    cur: list[str | bytes | None] = list(tokens)
    first: dict[int, str | bytes] = {}
    byte_ids: set[int] = set()
    mode = "stream"
    fused = False
    strip_leading = 0
    if not steps:  # no decoder: tokens joined with single spaces
        steps = [{"type": "_join"}]

    def each(fn: Any) -> None:
        for i, s in enumerate(cur):
            if s is not None and i not in byte_ids:
                cur[i] = fn(s)
        for i, s in list(first.items()):
            first[i] = fn(s)

    for step in steps:
        kind = step.get("type")
        if fused:
            if kind == "Strip" and step.get("content") == " " and step.get("stop", 0) == 0:
                strip_leading += int(step.get("start", 0))
                continue
            raise _Unsupported(f"{kind} after the text is fused")
        if kind == "Replace":
            pattern = step.get("pattern", {})
            if "String" not in pattern:
                raise _Unsupported("Replace with a regex pattern")
            old, new = pattern["String"], step.get("content", "")
            each(lambda s, old=old, new=new: s.replace(old, new) if isinstance(s, str) else s)
        elif kind == "ByteFallback":
            for i, s in enumerate(cur):
                if isinstance(s, str):
                    m = _BYTE_TOKEN.match(s)
                    if m:
                        cur[i] = bytes([int(m.group(1), 16)])
                        byte_ids.add(i)
                        first.pop(i, None)
            mode = "hf_runs"
        elif kind == "Fuse":
            fused = True
        elif kind == "Strip":
            content = step.get("content", " ")
            start, stop = int(step.get("start", 0)), int(step.get("stop", 0))

            def strip(s: Any, c: str = content, a: int = start, b: int = stop) -> Any:
                if not isinstance(s, str):
                    return s
                i = 0
                while i < a and i < len(s) and s[i] == c:
                    i += 1
                j = len(s)
                while len(s) - j < b and j > i and s[j - 1] == c:
                    j -= 1
                return s[i:j]

            each(strip)
        elif kind == "ByteLevel":
            alphabet = byte_level_alphabet()
            # A token made only of alphabet characters maps to their bytes; any other
            # character makes tokenizers keep the token's own UTF-8 (added tokens).
            table = str.maketrans({c: chr(b) for c, b in alphabet.items()})
            outside = re.compile("[^" + re.escape("".join(alphabet)) + "]")

            def to_bytes(s: Any, table: dict[int, str] = table, outside: Any = outside) -> Any:
                if not isinstance(s, str):
                    return s
                if outside.search(s):
                    return s.encode("utf-8")
                return s.translate(table).encode("latin-1")

            each(to_bytes)
            if mode == "hf_runs":
                raise _Unsupported("ByteLevel after ByteFallback")
            fused = True
        elif kind == "Metaspace":
            repl = step.get("replacement", "▁")
            scheme = step.get("prepend_scheme")
            if scheme is None:
                scheme = "always" if step.get("add_prefix_space", True) else "never"
            for i, s in enumerate(cur):
                if isinstance(s, str) and i not in byte_ids:
                    f = first.get(i, s)
                    if scheme != "never" and isinstance(f, str):
                        first[i] = f.replace(repl, "")
                    cur[i] = s.replace(repl, " ")
        elif kind in ("WordPiece", "_join"):
            prefix = step.get("prefix", "##") if kind == "WordPiece" else None
            do_clean = bool(step.get("cleanup", False)) if kind == "WordPiece" else False
            clean = wordpiece_cleanup

            for i, s in enumerate(cur):
                if not isinstance(s, str):
                    continue
                f = first.get(i, s)
                has_prefix = prefix is not None and s.startswith(prefix)
                s = s[len(prefix or "") :] if has_prefix else " " + s
                cur[i] = clean(s) if do_clean else s
                if isinstance(f, str):
                    first[i] = clean(f) if do_clean else f
            fused = kind == "_join"
        else:
            raise _Unsupported(f"decoder step {kind}")
    pieces: list[bytes | None] = [
        None if s is None else (s if isinstance(s, bytes) else s.encode("utf-8")) for s in cur
    ]
    first_b = {
        i: (s if isinstance(s, bytes) else s.encode("utf-8"))
        for i, s in first.items()
        if (s if isinstance(s, bytes) else s.encode("utf-8")) != pieces[i]
    }
    return pieces, first_b, frozenset(byte_ids), mode, strip_leading


def vocab_from_hf_tokenizer(
    tok: Any,
    name: str = "tokenizers.Tokenizer",
    config: dict[str, Any] | None = None,
    cleanup: bool | None = None,
    oracle: Any = None,
    special_ids: set[int] | None = None,
    spec: dict[str, Any] | None = None,
) -> Vocab:
    """Compile a `tokenizers.Tokenizer` (and its decoder pipeline) into a Vocab.

    `spec` is the tokenizer's JSON when the caller has already parsed it.
    """
    if spec is None:
        spec = json.loads(tok.to_str())
    size = tok.get_vocab_size(with_added_tokens=True)
    table = tok.get_vocab(with_added_tokens=True)
    size = max(size, max(table.values(), default=-1) + 1)
    tokens: list[str | None] = [None] * size
    for s, i in table.items():
        tokens[i] = s
    special = set(special_ids or ())
    for added in spec.get("added_tokens", []):
        if added.get("special"):
            special.add(int(added["id"]))
    if cleanup is None:
        cleanup = bool((config or {}).get("clean_up_tokenization_spaces", False))

    def reference(ids: Sequence[int], skip: bool) -> str:
        return tok.decode(list(ids), skip_special_tokens=skip)

    try:
        pieces, first, byte_ids, mode, strip = _compile_decoder(
            _flatten(spec.get("decoder")), tokens
        )
    except _Unsupported as why:
        from .formats import generic_vocab

        log.info("%s: %s; using the generic decode path", name, why)
        return generic_vocab(
            tokens, special, oracle or reference, name=name, cleanup=bool(cleanup), source=tok
        )
    if oracle is None:
        if cleanup:
            from .align import _cleanup

            def oracle(ids: Sequence[int], skip: bool) -> str:
                return _cleanup(reference(ids, skip))
        else:
            oracle = reference
    return Vocab(
        pieces=pieces,
        name=name,
        special=frozenset(special),
        byte_ids=byte_ids,
        byte_mode=mode,  # type: ignore[arg-type]
        first_pieces=first,
        strip_leading=strip,
        cleanup=bool(cleanup),
        names={i: t for i, t in enumerate(tokens) if t is not None and i in special},
        oracle=oracle,
        source=tok,
    )


def _skipped_by(tok: Any, token_id: int) -> bool:
    """Whether a transformers tokenizer's decode drops this id with skip_special_tokens."""
    try:
        shown = tok.decode([token_id], skip_special_tokens=False)
        return bool(shown) and tok.decode([token_id], skip_special_tokens=True) == ""
    except Exception:  # an id the tokenizer cannot decode alone is not a special token
        return False


def vocab_from_transformers(tok: Any) -> Vocab:
    """A transformers tokenizer: its tokenizers backend plus its own clean-up rule."""
    backend = getattr(tok, "_tokenizer", None) or getattr(tok, "backend_tokenizer", None)
    cleanup = bool(getattr(tok, "clean_up_tokenization_spaces", False))
    if cleanup and backend is not None:
        # Versions differ on when the clean-up really runs (transformers 5 skips it for
        # BPE models unless forced): ask the tokenizer itself on a probe.
        probe = backend.encode("a , b", add_special_tokens=False).ids
        cleanup = tok.decode(probe) != backend.decode(probe, skip_special_tokens=False)

    def oracle(ids: Sequence[int], skip: bool) -> str:
        return tok.decode(list(ids), skip_special_tokens=skip)

    special_ids = set(getattr(tok, "all_special_ids", []) or [])
    if backend is not None and type(backend).__module__.startswith("tokenizers"):
        # What skip_special_tokens drops is the backend's special added tokens, which
        # need not be all of `all_special_ids` (a GGUF's user-defined `</s>` named as EOS
        # is one, kept by transformers 5): ask the tokenizer about each candidate.
        candidates = special_ids | {int(i) for i in backend.get_added_tokens_decoder()}
        special_ids = {i for i in candidates if _skipped_by(tok, i)}
        return vocab_from_hf_tokenizer(
            backend,
            name=type(tok).__name__,
            cleanup=cleanup,
            oracle=oracle,
            special_ids=special_ids,
        )
    if hasattr(tok, "convert_ids_to_tokens") and hasattr(tok, "__len__"):
        # A Python-side ("slow") tokenizer: its decode has rules of its own (transformers'
        # sentencepiece backend prints byte pieces as "<0xNN>", for one), so take the
        # generic path, which is exact against its decode whatever those rules are.
        from .formats import generic_vocab

        n = len(tok)
        names = tok.convert_ids_to_tokens(list(range(n)))
        return generic_vocab(
            [t if isinstance(t, str) else None for t in names],
            special_ids,
            oracle,
            name=type(tok).__name__,
            source=tok,
        )
    raise TokenizerLoadError(
        f"transformers tokenizer {type(tok).__name__} has neither a tokenizers backend "
        "nor a sentencepiece model; pass its tokenizer files instead"
    )


# -- sentencepiece ----------------------------------------------------------------------


def vocab_from_sentencepiece(sp: Any, name: str = "sentencepiece") -> Vocab:
    """Compile a SentencePieceProcessor, following its own decode rules."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    norm = proto.normalizer_spec
    if proto.trainer_spec.treat_whitespace_as_suffix:
        raise TokenizerLoadError(f"{name}: treat_whitespace_as_suffix models are not supported")
    strip_all = norm.remove_extra_whitespaces
    strip_one = norm.add_dummy_prefix or strip_all
    n = sp.get_piece_size()
    pieces: list[bytes | None] = []
    first: dict[int, bytes] = {}
    hidden: set[int] = set()
    byte_ids: set[int] = set()
    names: dict[int, str] = {}
    for i in range(n):
        piece = sp.id_to_piece(i)
        if sp.is_control(i):
            pieces.append(b"")
            hidden.add(i)
            names[i] = piece
        elif sp.is_unknown(i):
            pieces.append(sp.decode([i]).encode("utf-8"))
            names[i] = piece
        elif sp.is_byte(i):
            m = _BYTE_TOKEN.match(piece)
            if not m:
                raise TokenizerLoadError(f"{name}: byte piece {piece!r} is malformed")
            pieces.append(bytes([int(m.group(1), 16)]))
            byte_ids.add(i)
        else:
            pieces.append(piece.replace("▁", " ").encode("utf-8"))
            if strip_one and piece.startswith("▁"):
                head = piece.lstrip("▁") if strip_all else piece[1:]
                first[i] = head.replace("▁", " ").encode("utf-8")

    def oracle(ids: Sequence[int], skip: bool) -> str:
        return sp.decode(list(ids))

    return Vocab(
        pieces=pieces,
        name=name,
        hidden=frozenset(hidden),
        byte_ids=frozenset(byte_ids),
        byte_mode="spm_runs",
        first_pieces=first,
        first_until_text=strip_all,
        skipped_breaks_runs=True,
        names=names,
        oracle=oracle,
        source=sp,
    )


# -- tiktoken ---------------------------------------------------------------------------

#: Llama 3's special tokens are not stored in its rank file; these are its names.
_LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]

_GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def tiktoken_specials(n_ranks: int, path: Path | None = None) -> dict[str, int]:
    """Special tokens for well-known rank files that do not store them."""
    if n_ranks == 128000:  # Llama 3.x
        names = _LLAMA3_SPECIALS + [
            f"<|reserved_special_token_{i}|>" for i in range(2, 256 - len(_LLAMA3_SPECIALS) + 2)
        ]
        return {s: n_ranks + k for k, s in enumerate(names[:256])}
    if n_ranks == 50256:  # GPT-2 ranks (as shipped by Whisper)
        return {"<|endoftext|>": 50256}
    if n_ranks == 151643:  # Qwen
        out = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
        for k in range(205):
            out[f"<|extra_{k}|>"] = 151646 + k
        return out
    return {}


def vocab_from_tiktoken_file(path: Path, special_tokens: dict[str, int] | None = None) -> Vocab:
    import tiktoken

    ranks: dict[bytes, int] = {}
    lineno = 0
    try:
        for lineno, line in enumerate(path.read_bytes().splitlines(), 1):  # noqa: B007
            if not line.strip():
                continue
            tok_b64, _, rank = line.partition(b" ")
            ranks[base64.b64decode(tok_b64)] = int(rank)
    except (ValueError, base64.binascii.Error) as e:  # type: ignore[attr-defined]
        raise TokenizerLoadError(f"{path}: bad tiktoken line {lineno}: {e}") from e
    specials = special_tokens if special_tokens is not None else tiktoken_specials(len(ranks), path)
    pat = _LLAMA3_PAT if len(ranks) > 100000 else _GPT2_PAT
    enc = tiktoken.Encoding(
        name=path.name, pat_str=pat, mergeable_ranks=ranks, special_tokens=specials
    )
    v = vocab_from_tiktoken(enc)
    v.name = str(path)
    return v


def vocab_from_tiktoken(enc: Any) -> Vocab:
    """Compile a tiktoken.Encoding: bytes per rank, special tokens as their text."""
    n = enc.n_vocab
    pieces: list[bytes | None] = [None] * n
    for b, i in enc._mergeable_ranks.items():
        pieces[i] = b
    special_map: dict[str, int] = dict(enc._special_tokens)
    for s, i in special_map.items():
        if i >= len(pieces):
            pieces.extend([None] * (i + 1 - len(pieces)))
        pieces[i] = s.encode("utf-8")
    special = frozenset(special_map.values())

    def oracle(ids: Sequence[int], skip: bool) -> str:
        ids = [i for i in ids if not (skip and i in special)]
        return enc.decode(ids)

    return Vocab(
        pieces=pieces,
        name=getattr(enc, "name", "tiktoken"),
        special=special,
        names={i: s for s, i in special_map.items()},
        oracle=oracle,
        source=enc,
    )
