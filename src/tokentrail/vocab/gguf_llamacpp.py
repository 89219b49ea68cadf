"""llama.cpp's decode of a GGUF vocabulary, rebuilt from the file's metadata alone.

What llama.cpp streams (llama-server, llama-cpp-python, LM Studio, Ollama) is every
token's `llama_token_to_piece(vocab, id, buf, len, lstrip=0, special)` concatenated. This
module computes those pieces from the `tokenizer.ggml.*` metadata, without llama.cpp or
torch, following llama.cpp's `llama_vocab::impl::load` and `token_to_piece` (read in
the llama.cpp bundled with llama-cpp-python 0.3.36, `src/llama-vocab.cpp`):

- Token types become attributes: normal, unknown, control, user-defined, unused, byte,
  anything else undefined. An empty token text is replaced by `[EMPTY_<id>]`.
- Some tokens are re-typed by their text at load time: end-of-generation and
  fill-in-the-middle markers that the file leaves normal or user-defined become control
  (DeepSeek's `<｜fim▁begin｜>`, `<｜end▁of▁sentence｜>`, `<|im_end|>`, ...); gpt-oss's
  `<|channel|>`/`<|message|>`/`<|start|>`/`<|constrain|>` become user-defined; two
  model-specific fixes re-type `<|end|>` and `</s>`. The text lists are in
  `_EOT_TEXTS`, `_FIM_TEXTS` and `_EOG_TEXTS`.
- `token_to_piece(id, special)`: unknown and control tokens give nothing unless
  `special` (then their text); user-defined tokens give their UTF-8 text; byte tokens
  (`<0xNN>`) give the raw byte; normal tokens give their text with U+2581 turned into a
  space (SPM `llama`, WPM `bert`, UGM `t5`, and BPE vocabularies whose pre-tokenizer
  escapes whitespace, such as Gemma 4), or their byte-level BPE characters mapped back
  to bytes (GPT-2 style `gpt2` vocabularies; a character outside that alphabet gives
  `[UNK_BYTE_0x<hex>` + the token text + `]`); unused and undefined tokens give nothing.
- No space is stripped anywhere: not the SPM dummy prefix, not after BOS, whatever
  `add_space_prefix` and `add_bos_token` say (those only change `llama_detokenize`).

`skip_special_tokens=False` is `special=True` (control tokens shown as their text) and
`skip_special_tokens=True` is `special=False`.

The text is the bytes decoded as UTF-8 with every maximal invalid subsequence replaced by
one U+FFFD (Python's `errors="replace"`). That is what llama-server sends: it holds back
an incomplete character at the end of the generated text and serialises the rest with
nlohmann::json's `error_handler_t::replace`, which uses the same rule. llama-cpp-python's
`create_completion` instead decodes with `errors="ignore"` (invalid bytes vanish), and its
`Llama.detokenize` drops one leading space when the first token is BOS; neither is what
the engine produced, so neither is reproduced here.

Where several texts of one fill-in-the-middle category are in a vocabulary whose file
names no id for it, llama.cpp re-types the first one its hash map yields; here all of
them are treated as control.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import UnsupportedGGUF
from .core import Vocab, byte_level_alphabet

log = logging.getLogger(__name__)

# llama.h `llama_token_attr` bits.
UNDEFINED, UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = 0, 1, 2, 4, 8, 16, 32
#: GGUF `tokenizer.ggml.token_type` values (sentencepiece's numbering) -> attributes.
_TYPE_ATTR = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}

#: tokenizer.ggml.model -> how normal tokens are written.
_ESCAPED = {"llama", "bert", "t5"}  # SPM, WPM, UGM: U+2581 for a space
_BPE = {"gpt2", "whitespace", "gemma4"}  # byte-level alphabet (unless escaped, below)
#: BPE pre-tokenizers whose normal tokens are written with U+2581 for a space.
_ESCAPED_BPE_PRE = {"gemma4", "sarvam-moe", "granite-embed-multi-311m"}

#: Texts llama.cpp looks for when the file names no end-of-turn / end-of-message id.
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)  # fmt: skip
_EOM_TEXTS = ("<|eom_id|>",)
#: Fill-in-the-middle markers by category (GGUF key suffix -> texts).
_FIM_TEXTS: dict[str, tuple[str, ...]] = {
    "fim_pre": (
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
        "▁<PRE>", "<|code_prefix|>", "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
        "▁<SUF>", "<|code_suffix|>", "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
        "▁<MID>", "<|code_middle|>", "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
#: Deprecated keys that also name a fill-in-the-middle id.
_FIM_OLD_KEYS = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}
#: Texts that always mark an end-of-generation token (and make it control).
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
    "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
    "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
    "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
)  # fmt: skip
#: gpt-oss tokens llama.cpp always renders (re-typed user-defined).
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
#: Default EOS id per tokenizer model when the file names none.
_DEFAULT_EOS = {"llama": 2, "gpt2": 11, "whitespace": 11, "t5": 1}

_HEX = re.compile(r"[0-9A-Fa-f]{1,2}")

SUPPORTED_MODELS = tuple(sorted(_ESCAPED | _BPE))




def _meta_id(meta: dict[str, Any], key: str, n: int) -> int | None:
    """An id named by the metadata, or None when absent or out of range (llama.cpp
    ignores an out-of-range id with a warning)."""
    value = meta.get(f"tokenizer.ggml.{key}_token_id")
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < n else None


def attributes(
    model: str, tokens: Sequence[str], types: Sequence[int] | None, meta: dict[str, Any]
) -> list[int]:
    """llama.cpp's per-token attributes after loading: the types, then its re-typing."""
    return load_attributes(model, tokens, types, meta)[0]


def load_attributes(
    model: str, tokens: Sequence[str], types: Sequence[int] | None, meta: dict[str, Any]
) -> tuple[list[int], frozenset[int]]:
    """llama.cpp's per-token attributes after loading (see `attributes`), and its
    end-of-generation ids (``special_eog_ids``: the ids `llama_vocab_is_eog` is true of,
    on which llama.cpp and llama-server stop)."""
    n = len(tokens)
    attr = [NORMAL] * n if types is None else [_TYPE_ATTR.get(int(t), UNDEFINED) for t in types]
    by_text: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in by_text:
            raise ValueError(
                f"tokens {by_text[t]} and {i} are both {t!r}; llama.cpp refuses such a file"
            )
        by_text[t] = i

    def ids_of(texts: Iterable[str]) -> list[int]:
        return [by_text[t] for t in texts if t in by_text]

    def make_control(ids: Iterable[int]) -> None:
        for i in ids:
            attr[i] |= CONTROL

    # Categories the file names no id for are found by their text (and made control).
    eot = _meta_id(meta, "eot", n)
    eom = _meta_id(meta, "eom", n)
    if eot is None:  # every end-of-turn text is also an end-of-generation one (below)
        found = ids_of(_EOT_TEXTS)
        make_control(found)
        eot = found[0] if found else None
    if eom is None:
        found = ids_of(_EOM_TEXTS)
        make_control(found)
        eom = found[0] if found else None
    fim: dict[str, list[int]] = {}
    for key, texts in _FIM_TEXTS.items():
        named = _meta_id(meta, key, n)
        old = _FIM_OLD_KEYS.get(key)
        if old is not None and _meta_id(meta, old, n) is not None:
            named = _meta_id(meta, old, n)
        if named is not None:
            fim[key] = [named]
            continue
        found = ids_of(texts)
        if len(found) > 1:
            log.info("GGUF has several %s markers %s; all are taken as control", key, found)
        make_control(found)
        fim[key] = found
    # End-of-generation tokens: by text, plus the FIM pad/repo/sep and EOS/EOT/EOM ids.
    eog = set(ids_of(_EOG_TEXTS))
    make_control(eog)
    for key in ("fim_pad", "fim_rep", "fim_sep"):
        eog.update(fim[key])
    eos = _meta_id(meta, "eos", n)
    if eos is None and "tokenizer.ggml.eos_token_id" not in meta:
        default = _DEFAULT_EOS.get(model)
        eos = default if default is not None and default < n else None
    eog.update(i for i in (eos, eot, eom) if i is not None)
    for i in ids_of(_ALWAYS_RENDERED):
        attr[i] = USER_DEFINED
    eog_text = {tokens[i] for i in eog}
    has_call = "<|call|>" in eog_text or "<|calls|>" in eog_text
    if "<|end|>" in eog_text and has_call and ({"<|return|>", "<|flush|>"} & eog_text):
        for i in list(eog):
            if tokens[i] == "<|end|>":
                attr[i] = USER_DEFINED
                eog.discard(i)  # and it no longer ends generation
    if "</s>" in eog_text and ({"<|tool_response>", "<|plamo:eos|>"} & eog_text):
        for i in list(eog):
            if tokens[i] == "</s>":
                attr[i] = NORMAL
                eog.discard(i)
    return attr, frozenset(eog)


def _byte_of(text: str) -> bytes:
    """A byte token's value: the hex digits after `<0x` (strtol's reading of them)."""
    m = _HEX.match(text, 3)
    return bytes([int(m.group(0), 16) if m else 0])


def pieces(model: str, pre: str, tokens: Sequence[str], attr: Sequence[int]) -> list[bytes]:
    """`llama_token_to_piece(id, special=True)` for every id."""
    if model not in _ESCAPED | _BPE:
        raise UnsupportedGGUF(
            f"GGUF tokenizer model {model!r} has no llama.cpp decode rule here "
            f"(supported: {', '.join(SUPPORTED_MODELS)})"
        )
    escaped = model in _ESCAPED or model == "gemma4" or pre in _ESCAPED_BPE_PRE
    to_byte = {c: b for c, b in byte_level_alphabet().items()}
    out: list[bytes] = []
    for text, a in zip(tokens, attr, strict=True):
        if a & (UNKNOWN | CONTROL | USER_DEFINED):
            out.append(text.encode("utf-8"))
        elif a & NORMAL:
            if escaped:
                out.append(text.replace("\u2581", " ").encode("utf-8"))
            else:
                buf = bytearray()
                for c in text:
                    b = to_byte.get(c)
                    if b is not None:
                        buf.append(b)
                    else:
                        hexed = c.encode("utf-8").hex()
                        buf += f"[UNK_BYTE_0x{hexed}{text}]".encode()
                out.append(bytes(buf))
        elif a & BYTE and model != "bert":
            out.append(_byte_of(text))
        else:  # unused, undefined (and byte tokens in a WPM vocabulary)
            out.append(b"")
    return out


def named_tokens(tokens: Sequence[str]) -> list[str]:
    """The token texts as llama.cpp loads them: an empty text becomes ``[EMPTY_<id>]``
    (llama-vocab.cpp's loader does so, so that every text names one id)."""
    return [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]


def llamacpp_vocab(
    name: str,
    model: str,
    pre: str,
    tokens: Sequence[str],
    types: Sequence[int] | None,
    meta: dict[str, Any],
) -> Vocab:
    """A Vocab whose decode is llama.cpp's concatenation of token pieces."""
    tokens = named_tokens(tokens)
    attr = attributes(model, tokens, types, meta)
    table = pieces(model, pre, tokens, attr)
    special = frozenset(i for i, a in enumerate(attr) if a & (UNKNOWN | CONTROL))
    table_l: list[bytes | None] = list(table)

    def oracle(ids: Sequence[int], skip: bool) -> str:
        data = b"".join(table[i] for i in ids if not (skip and i in special))
        return data.decode("utf-8", "replace")

    return Vocab(
        pieces=table_l,
        name=f"{name} (llama.cpp)",
        special=special,
        byte_mode="stream",
        names={i: tokens[i] for i in special},
        oracle=oracle,
    )
