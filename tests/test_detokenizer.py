"""The mlx-lm drop-in detokenizer inside mlx-lm's own TokenizerWrapper."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

from tests.helpers.env import corpus_path
from tokentrail import load_vocab
from tokentrail.detokenizer import StreamingDetokenizer, install


def _wrapper(name: str, file: str):
    from mlx_lm.tokenizer_utils import load

    folder = Path(tempfile.mkdtemp(prefix="tt-detok-"))
    (folder / "tokenizer.json").symlink_to(corpus_path("tokenizers", name, file))
    return load(folder)


def test_drop_in_gives_exact_text_and_segment_tokens() -> None:
    wrapper = _wrapper("gpt2", "tokenizer.json")
    install(wrapper)
    text = " leading space, Ā NUL-ish and 🙂👍🏽 你好"
    ids = wrapper.encode(text)
    det = wrapper.detokenizer
    assert isinstance(det, StreamingDetokenizer)
    pieces, seen = [], []
    for i in ids:
        det.add_token(i)
        seg = det.last_segment
        pieces.append(seg)
        seen.extend(t.index for t in det.last_segment_tokens)
        if seg:
            assert det.last_segment_tokens, "text always comes with the tokens behind it"
    det.finalize()
    pieces.append(det.last_segment)
    seen.extend(t.index for t in det.last_segment_tokens)
    assert "".join(pieces) == det.text == wrapper.decode(ids)
    assert sorted(set(seen)) == list(range(len(ids)))
    assert det.tokens == ids


def test_copies_do_not_share_state() -> None:
    """mlx-lm hands each request a shallow copy; streams must not mix."""
    wrapper = _wrapper("gpt2", "tokenizer.json")
    install(wrapper)
    a, b = wrapper.detokenizer, copy.copy(wrapper.detokenizer)
    b.reset()
    for i in wrapper.encode("alpha"):
        a.add_token(i)
    for i in wrapper.encode("beta"):
        b.add_token(i)
    a.finalize()
    b.finalize()
    assert (a.text, b.text) == ("alpha", "beta")


def test_inside_mlx_lm_stream_generate_on_the_demo_model() -> None:
    """The seed's scenario: mlx-lm's own stream_generate with the drop-in installed. mlx-lm
    works on its own copy of the detokenizer; the object `install` returned still holds,
    after each response, the tokens behind that response's text."""
    import mlx_lm

    from tokentrail.generate import DEMO_MODEL

    model, tokenizer = mlx_lm.load(str(DEMO_MODEL))
    detok = install(tokenizer)
    for prompt in ("The word for water is", "def main():"):  # two streams: no leftovers
        texts, tokens, spans = [], [], []
        for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=40):
            texts.append(r.text)
            tokens.append(r.token)
            if r.text:
                assert detok.last_segment_tokens, "text always comes with its tokens"
            spans.extend(detok.last_segment_tokens)
        eos = set(tokenizer.eos_token_ids)
        body = tokens[:-1] if tokens[-1] in eos else tokens
        assert "".join(texts) == tokenizer.decode(body)
        assert sorted({t.index for t in spans}) == list(range(len(body)))
        covered: dict[int, int] = {}
        for t in spans:  # each token's bytes covered once, in order, across responses
            assert t.id == body[t.index]
            assert t.start == covered.get(t.index, 0)
            covered[t.index] = t.end
        # byte-level BPE: the bytes each token gave, joined, are the text's bytes
        vocab = load_vocab(tokenizer)
        got = b"".join(vocab.token_bytes(t.id)[t.start : t.end] for t in spans)
        assert got == "".join(texts).encode()


# The texts of mlx-lm's own detokenizer test, ported from ml-explore/mlx-lm
# tests/test_tokenizers.py (TestTokenizers.check_tokenizer): each is encoded, streamed
# token by token through the detokenizer, and must decode exactly as tokenizer.decode.
MLX_LM_TEXTS = [
    "こんにちは！私の名前はAI",
    "⊕ ⊻ ∧ ¬",
    "a ,b",
    '{"why_its_funny" :"a_joke_explainer" ,"rating":3.5}',
    "3 3",
    "import 'package:flutter/material.dart';",
    "hello\nworld",
]


def _folder(name: str, files: dict[str, str], config: dict | None = None) -> Path:
    import json

    folder = Path(tempfile.mkdtemp(prefix="tt-detok-"))
    for target, source in files.items():
        (folder / target).symlink_to(corpus_path("tokenizers", name, source))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def _tokenizers() -> list[tuple[str, Path]]:
    return [
        ("gpt2 (byte-level BPE)", _folder("gpt2", {"tokenizer.json": "tokenizer.json"})),
        ("gpt-neox", _folder("gpt-neox", {"tokenizer.json": "20B_tokenizer.json"})),
        (
            "qwen2 (BPE, like mlx-lm's Qwen1.5 case)",
            _folder(
                "qwen2",
                {f: f for f in ("vocab.json", "merges.txt", "tokenizer_config.json")},
            ),
        ),
        (
            "llama2 (SentencePiece, like mlx-lm's Mistral case)",
            _folder(
                "llama2",
                {"tokenizer.model": "tokenizer.model"},
                {"tokenizer_class": "LlamaTokenizer", "legacy": True},
            ),
        ),
    ]


def test_mlx_lm_detokenizer_texts_through_the_drop_in() -> None:
    from mlx_lm.tokenizer_utils import load

    for name, folder in _tokenizers():
        wrapper = load(folder)
        install(wrapper)
        for text in MLX_LM_TEXTS:
            tokens = wrapper.encode(text)
            expected = wrapper.decode(tokens)
            det = wrapper.detokenizer
            det.reset()
            out, seen = "", []
            for e, t in enumerate(tokens):
                det.add_token(t)
                out += det.last_segment
                seen += [s.index for s in det.last_segment_tokens]
                assert det.tokens == tokens[: e + 1], (name, text)
            det.finalize()
            out += det.last_segment
            seen += [s.index for s in det.last_segment_tokens]
            assert out == expected, (name, text)
            assert sorted(set(seen)) == list(range(len(tokens))), (name, text)


def test_special_tokens() -> None:
    # ported: mlx-lm tests/test_tokenizers.py TestTokenizers.test_special_tokens (there on
    # DeepSeek-Coder; here on GPT-2's <|endoftext|>): a lone special token is its text.
    wrapper = _wrapper("gpt2", "tokenizer.json")
    install(wrapper)
    eos = wrapper.convert_tokens_to_ids("<|endoftext|>")
    det = wrapper.detokenizer
    det.reset()
    det.add_token(eos)
    det.finalize()
    assert det.last_segment == "<|endoftext|>" == wrapper.decode([eos])
    assert [t.id for t in det.last_segment_tokens] == [eos]
