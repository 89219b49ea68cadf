"""A constraint that starts after the reasoning: the guide's gate, on real tokenizers.

Token sequences come from the tokenizer's own `encode` (Qwen2's tokenizer from the corpus,
the demo model's); the oracle for where the reasoning ends is the tokenizer's own decode
of each prefix, and for what the grammar allows afterwards a fresh llguidance matcher
fed the content bytes (llguidance's own tokenization), never the guide under test.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

llg = pytest.importorskip(
    "llguidance", reason="llguidance is not installed: pip install -e '.[constrain]'"
)
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.helpers.env import CORPUS, corpus_path  # noqa: E402
from tests.helpers.real_tokenizers import DEMO  # noqa: E402
from tokentrail.constrain import constraint_from  # noqa: E402
from tokentrail.errors import EngineError  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}  # fmt: skip
END = "</think>"


@pytest.fixture(scope="module", params=["qwen2", "demo"])
def tok(request: pytest.FixtureRequest) -> Any:
    path = CORPUS / "tokenizers" / "qwen2" if request.param == "qwen2" else DEMO
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _enc(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _guide(tok: Any, ends: tuple[str, ...] = (END,)) -> Any:
    return constraint_from(json_schema=SCHEMA).bind(tok).after_reasoning(ends).guide()


def _oracle_mask(c: Any, content: bytes, width: int) -> np.ndarray:
    """What llguidance allows after `content`, from a fresh matcher."""
    m = llg.LLMatcher(c.tokenizer, c.grammar, log_level=0)
    ids = c.tokenizer.tokenize_bytes(content)
    assert m.consume_tokens(ids), m.get_error()
    bits = llg.numpy.allocate_token_bitmask(1, c.tokenizer.vocab_size)
    llg.numpy.fill_next_token_bitmask(m, bits)
    out = np.unpackbits(bits.view(np.uint8), count=c.tokenizer.vocab_size, bitorder="little")
    return np.concatenate([out.astype(bool), np.zeros(width - out.size, dtype=bool)])


def _blank(c: Any, width: int) -> np.ndarray:
    """The whitespace-only ids (llguidance's bytes of each id), padded to `width`."""
    lt = c.tokenizer
    out = np.zeros(width, dtype=bool)
    for i in range(lt.vocab_size):
        b = lt.decode_bytes([i])
        out[i] = bool(b) and not b.strip(b" \t\r\n") and not lt.is_special_token(i)
    return out


def _ended_at(tok: Any, ids: list[int], marker: str) -> int:
    """The index of the token whose prefix decode first contains `marker` (-1: none)."""
    for i in range(len(ids)):
        if marker in tok.decode(ids[: i + 1]):
            return i
    return -1


def _walk(guide: Any, ids: list[int], width: int) -> list[bool]:
    """`active` before each token; every token must be allowed where it is fed."""
    seen = []
    for i in ids:
        seen.append(guide.active)
        assert guide.allowed(width)[i], f"id {i} not allowed"
        guide.advance(i)
    return seen


def test_inactive_until_a_marker_cut_across_tokens_completes(tok: Any) -> None:
    reasoning = "Let me see. The user wants JSON, so I answer with it."
    ids = _enc(tok, reasoning + " " + END)
    end = _ended_at(tok, ids, END)
    assert end > 0 and len(_enc(tok, END)) > 1  # the marker takes several tokens here
    width = len(tok)
    g = _guide(tok)
    seen = _walk(g, ids, width)
    assert seen == [False] * len(ids)  # inactive while reasoning, incl. the marker's tokens
    assert g.active
    mask = g.allowed(width)
    c = constraint_from(json_schema=SCHEMA).bind(tok)
    # what the grammar allows at its start, and one blank token (whitespace before it)
    np.testing.assert_array_equal(mask, _oracle_mask(c, b"", width) | _blank(c, width))
    assert not mask[_enc(tok, "Hello")[0]]
    g.advance(_enc(tok, "\n")[0])  # taken: JSON's leading whitespace (spec.LEADING_WHITESPACE)
    np.testing.assert_array_equal(g.allowed(width), _oracle_mask(c, b"\n", width))


def test_while_inactive_every_id_is_allowed(tok: Any) -> None:
    g = _guide(tok)
    width = len(tok) + 64  # padding rows past the vocabulary too, as unconstrained
    for i in _enc(tok, "No end marker in this reasoning at all, it just goes on"):
        assert g.allowed(width).all()
        g.advance(i)
    assert not g.active and not g.done


def _straddling(tok: Any, lead: bytes, follow: bytes) -> int | None:
    """A token of the vocabulary whose bytes are `lead` + something starting with
    `follow` (the content's first bytes after the marker's last byte)."""
    lt = constraint_from(json_object=True).bind(tok).tokenizer
    for i in range(lt.vocab_size):
        b = lt.decode_bytes([i])
        if b.startswith(lead + follow) and not lt.is_special_token(i):
            return i
    return None


def test_a_token_straddling_the_marker_feeds_its_tail_to_the_grammar(tok: Any) -> None:
    c = constraint_from(json_schema=SCHEMA).bind(tok)
    t = _straddling(tok, b">", b'{"')
    if t is None:
        pytest.skip("no token '>' + '{\"...' in this vocabulary")
    lt = c.tokenizer
    tail = lt.decode_bytes([t])[1:]
    head = _enc(tok, "Fine. </think")
    assert END not in tok.decode(head) and END in tok.decode([*head, t])
    width = len(tok)
    g = c.after_reasoning((END,)).guide()
    _walk(g, [*head, t], width)
    assert g.active
    np.testing.assert_array_equal(g.allowed(width), _oracle_mask(c, tail, width))


def test_leading_whitespace_in_the_tail_is_skipped_other_tails_are_errors(tok: Any) -> None:
    width = len(tok)
    g = _guide(tok)
    ids = _enc(tok, "ok </think>\n\n")  # the tokenizer merges the newlines into the tail
    _walk(g, ids, width)
    c = constraint_from(json_schema=SCHEMA).bind(tok)
    assert g.active
    # the grammar took the blank line, in the marker's tail or as a blank token after
    # it: JSON's leading whitespace (spec.LEADING_WHITESPACE)
    np.testing.assert_array_equal(g.allowed(width), _oracle_mask(c, b"\n\n", width))
    bad = next((t for t in map(lambda a: _straddling(tok, b">", a), (b"Hello", b"The", b"a"))
                if t is not None), None)  # fmt: skip
    if bad is None:
        return  # no token carries text past the marker: the grammar masks what follows
    bad_ids = [*_enc(tok, "ok </think"), bad]
    g = _guide(tok)
    with pytest.raises(EngineError, match="ended the reasoning"):
        _walk(g, bad_ids, width)


def test_a_special_token_as_the_end_marker() -> None:
    tok = transformers.AutoTokenizer.from_pretrained(str(CORPUS / "tokenizers" / "qwen2"))
    special = "<|im_start|>"  # a control token of this vocabulary, as Qwen3's </think>
    (sid,) = _enc(tok, special)
    assert sid in tok.all_special_ids
    g = _guide(tok, (special,))
    ids = [*_enc(tok, "some thoughts"), sid]
    assert _walk(g, ids, len(tok)) == [False] * len(ids)
    assert g.active
    body = _enc(tok, '{"ok":true,"n":3}')
    _walk(g, body, len(tok))
    assert g.done


def test_several_end_spellings_and_an_empty_tail(tok: Any) -> None:
    g = _guide(tok, ("Here is my response:", "Here's my response:"))
    ids = _enc(tok, "I thought. Here's my response:")
    seen = _walk(g, ids, len(tok))
    assert seen == [False] * len(ids) and g.active


@settings(max_examples=40, deadline=None)
@given(
    reasoning=st.text(st.sampled_from(list('ab </>think.\n{}"')), max_size=30),
    ok=st.booleans(),
    n=st.integers(-50, 10**6),
    gap=st.sampled_from(["", "\n", "\n\n"]),
)
def test_encoded_reasoning_then_json_validates(reasoning: str, ok: bool, n: int, gap: str) -> None:
    """Whole texts encoded at once (tokens straddle the marker as the tokenizer merges
    them): the guide stays off until the token the decode says completes the marker,
    then the content, as the tokenizer encoded it, is all allowed and completes
    (Qwen2's tokenizer puts the newlines in the marker's last token: the tail)."""
    tok = _qwen()
    while END in reasoning:
        reasoning = reasoning.replace(END, "")
    body = json.dumps({"ok": ok, "n": n}, separators=(",", ":"))
    ids = _enc(tok, reasoning + END + gap + body)
    end = _ended_at(tok, ids, END)
    g = _guide(tok)
    seen = _walk(g, ids, len(tok))
    assert seen == [False] * (end + 1) + [True] * (len(ids) - end - 1)
    assert g.done
    text = tok.decode(ids)
    jsonschema.validate(json.loads(text[text.index(END) + len(END) :]), SCHEMA)


_QWEN: list[Any] = []


def _qwen() -> Any:
    if not _QWEN:
        path = CORPUS / "tokenizers" / "qwen2"
        _QWEN.append(transformers.AutoTokenizer.from_pretrained(str(path)))
    return _QWEN[0]


def test_what_is_built_per_tokenizer_is_let_go_with_it() -> None:
    """llguidance's tokenizer and the whitespace ids made from it are kept while the
    model's tokenizer lives (made once) and let go with it: a process that loads one
    model after another holds none of the earlier ones'. (The whitespace ids were kept
    by the llguidance tokenizer's id forever, and each kept its tokenizer alive: about
    100 MB a model for Qwen2's vocabulary.)"""
    import gc
    import sys
    import weakref

    from tokentrail.constrain import lltokenizer as cache
    from tokentrail.constrain.gate import whitespace_ids

    tok = transformers.AutoTokenizer.from_pretrained(str(corpus_path("tokenizers", "qwen2")))
    seen = weakref.ref(tok)
    c = constraint_from(json_schema=SCHEMA).bind(tok)
    lltok = c.tokenizer
    ws = whitespace_ids(lltok)
    assert whitespace_ids(lltok) is ws  # made once
    assert cache.lltokenizer_for(tok) is lltok
    assert ws[lltok.tokenize_str(" ")].all() and not ws[lltok.tokenize_str("a")].any()
    del tok, c, ws
    gc.collect()
    assert seen() is None
    # Nothing but this test holds llguidance's tokenizer once the model's is gone (the
    # local name and getrefcount's own argument).
    assert sys.getrefcount(lltok) == 2
