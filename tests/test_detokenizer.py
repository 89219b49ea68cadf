"""The mlx-lm drop-in detokenizer inside mlx-lm's own TokenizerWrapper."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

from conftest import corpus_path

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
    """The seed's scenario: mlx-lm's own stream_generate with the drop-in installed; the
    tokens read after each `last_segment` cover every generated token exactly."""
    import mlx_lm

    from tokentrail.generate import DEMO_MODEL

    model, tokenizer = mlx_lm.load(str(DEMO_MODEL))
    install(tokenizer)
    texts, tokens, spans = [], [], []
    # mlx-lm reads `last_segment` inside stream_generate; the tokens behind that text are
    # on the detokenizer it uses, which we reach through the wrapper's per-call copy.
    seen: list[StreamingDetokenizer] = []
    original = type(tokenizer).detokenizer

    def spy(self: object) -> StreamingDetokenizer:
        det = original.fget(self)
        seen.append(det)
        return det

    type(tokenizer).detokenizer = property(spy)
    try:
        for r in mlx_lm.stream_generate(model, tokenizer, "The word for water is", max_tokens=40):
            texts.append(r.text)
            tokens.append(r.token)
            spans.extend(seen[-1].last_segment_tokens)
    finally:
        type(tokenizer).detokenizer = original
    det = seen[-1]
    assert "".join(texts) == det.text == tokenizer.decode(det.tokens)
    assert sorted({t.index for t in spans}) == list(range(len(det.tokens)))
    covered: dict[int, int] = {}
    for t in spans:  # each token's bytes covered once, in order, across responses
        assert t.id == det.tokens[t.index]
        assert t.start == covered.get(t.index, 0)
        covered[t.index] = t.end
