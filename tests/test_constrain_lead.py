"""A JSON constraint takes the whitespace JSON allows before its value (issue 18).

A token that merges whitespace into the value's first token (` {"`, `\\n{`) must not
be masked out, so a model whose natural first token is one keeps it. The oracle for
which tokens may open the reply is llguidance's own compact JSON grammar
(`grammar_from_json_schema`, no whitespace anywhere) fed each token's bytes less up to
`LEADING_WHITESPACE`'s count of leading blanks; outputs are validated by `jsonschema`
and their fields' tokens joined by hand from the vocabulary's bytes.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

llg = pytest.importorskip("llguidance", reason="llguidance is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")

from tests.helpers.env import CORPUS  # noqa: E402
from tests.helpers.real_tokenizers import DEMO  # noqa: E402
from tokentrail.constrain import constraint_from  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
BLANKS = 2  # LEADING_WHITESPACE's bound


@pytest.fixture(scope="module", params=["qwen2", "demo"])
def tok(request: pytest.FixtureRequest) -> Any:
    path = CORPUS / "tokenizers" / "qwen2" if request.param == "qwen2" else DEMO
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _mask(lt: Any, grammar: str) -> np.ndarray:
    m = llg.LLMatcher(lt, grammar, log_level=0)
    bits = llg.numpy.allocate_token_bitmask(1, lt.vocab_size)
    llg.numpy.fill_next_token_bitmask(m, bits)
    return np.unpackbits(bits.view(np.uint8), count=lt.vocab_size, bitorder="little").astype(bool)


def _compact_takes(lt: Any, compact: str, data: bytes) -> bool:
    m = llg.LLMatcher(lt, compact, log_level=0)
    ids = lt.tokenize_bytes(data)
    return m.try_consume_tokens(ids) == len(ids) and not m.is_error()


@pytest.mark.parametrize("kind", ["schema", "object"])
def test_first_tokens_may_carry_leading_whitespace(tok: Any, kind: str) -> None:
    c = (constraint_from(json_schema=SCHEMA) if kind == "schema" else
         constraint_from(json_object=True)).bind(tok)  # fmt: skip
    lt = c.tokenizer
    source = json.dumps(SCHEMA) if kind == "schema" else '{"type": "object"}'
    compact = llg.LLMatcher.grammar_from_json_schema(
        source, defaults={"whitespace_flexible": False}
    )
    allowed = _mask(lt, c.grammar)
    old = _mask(lt, compact)
    assert (allowed >= old).all()  # nothing the compact grammar allowed is lost
    merged = 0
    for i in range(lt.vocab_size):
        b = lt.decode_bytes([i])
        rest = b.lstrip(b" \t\r\n")
        if not b or lt.is_special_token(i) or rest == b:
            continue
        want = len(b) - len(rest) <= BLANKS and (not rest or _compact_takes(lt, compact, rest))
        assert allowed[i] == want, (i, b)
        merged += bool(rest) and want
    assert merged > 0  # the vocabulary has ` {` / `\n{`-like tokens, and they are allowed


def test_more_blanks_than_the_bound_are_masked(tok: Any) -> None:
    c = constraint_from(json_schema=SCHEMA).bind(tok)
    lt = c.tokenizer
    for lead in (b" ", b"\n", b"\n\n", b" \n"):
        ids = lt.tokenize_bytes(lead + b'{"name":"a","ok":true}')
        m = llg.LLMatcher(lt, c.grammar, log_level=0)
        assert m.try_consume_tokens(ids) == len(ids) and m.is_accepting(), lead
    ids = lt.tokenize_bytes(b'   {"name":"a","ok":true}')
    m = llg.LLMatcher(lt, c.grammar, log_level=0)
    assert m.try_consume_tokens(ids) < len(ids)


@pytest.fixture(scope="module")
def demo_model() -> Any:
    import tokentrail

    return tokentrail.load()  # the demo model (MLX)


@pytest.mark.parametrize("prompt", ["Reply in JSON.", "A name, in JSON:", "{", "\n", "Hi"])
def test_outputs_validate_and_fields_are_exact(demo_model: Any, prompt: str) -> None:
    import tokentrail

    model, tokenizer = demo_model
    pieces = tokentrail.Aligner(str(DEMO)).vocab.pieces
    responses = list(tokentrail.stream_generate(
        model, tokenizer, prompt, max_tokens=60, json_schema=SCHEMA, fields=True
    ))  # fmt: skip
    text = "".join(r.text for r in responses)
    jsonschema.validate(json.loads(text), SCHEMA)
    last = responses[-1]
    assert last.fields_error is None and len(last.all_fields) == 2
    decoder = json.JSONDecoder()
    for f in last.all_fields:
        value, end = decoder.raw_decode(text, f.start)
        assert (value, text[f.start : end]) == (f.value, f.text)
        joined = b"".join(pieces[t.id][t.start : t.end] for t in f.tokens)
        assert joined == f.text.encode("utf-8"), f


def test_leading_whitespace_false_is_llguidances_compact_grammar(tok: Any) -> None:
    """The tool-call constraint's choice (the reply is only the call)."""
    c = constraint_from(json_schema=SCHEMA, leading_whitespace=False).bind(tok)
    compact = llg.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "lenient": False}
    )
    np.testing.assert_array_equal(_mask(c.tokenizer, c.grammar), _mask(c.tokenizer, compact))
