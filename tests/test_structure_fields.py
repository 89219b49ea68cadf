"""JSON fields: each leaf's path, value, exact text and narrowed tokens.

Positions are checked against oracles that are not the code under test: the serialiser
here, which records where it wrote each leaf while it writes JSON with random white
space; `json.JSONDecoder.raw_decode` started at each reported position (it must parse
exactly that value and stop exactly at the reported end); and RFC 6901 resolution of
each path in `json.loads` of the whole text. Tokens are checked against each token's own
bytes from real tokenizers (the demo model's, Qwen2's from the corpus).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import require
from tests.helpers.real_tokenizers import DEMO, Tok
from tokentrail import Segment, TokenSpan, confidence_of
from tokentrail.errors import StructureError
from tokentrail.structure import (
    NO_SCORER,
    FieldStream,
    TokenPlacement,
    allowed_values,
    json_fields,
)


@pytest.fixture(scope="module")
def demo() -> Tok:
    tokenizers = require("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    return Tok(lambda s: tok.encode(s, add_special_tokens=False).ids, str(DEMO))


@pytest.fixture(scope="module")
def qwen2(corpus: Path) -> Tok:
    transformers = require("transformers")
    folder = corpus / "tokenizers" / "qwen2"
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return Tok(lambda s: tok.encode(s, add_special_tokens=False), str(folder))


@pytest.fixture(scope="module", params=["demo", "qwen2"])
def tok(request: pytest.FixtureRequest) -> Tok:
    return request.getfixturevalue(request.param)


# -- the oracles ---------------------------------------------------------------------


def resolve(doc: Any, pointer: str) -> Any:
    """RFC 6901, read straight from the RFC: split on "/", then ~1 -> "/", ~0 -> "~"."""
    if pointer == "":
        return doc
    assert pointer.startswith("/")
    for token in pointer[1:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        doc = doc[int(token)] if isinstance(doc, list) else doc[token]
    return doc


def check_fields(tok: Tok, text: str, expected: list[tuple[str, int, int]] | None = None):
    """Fields of `text` (tokenized by `tok`), checked against every oracle."""
    segments = tok.segments(text, logprobs=True)
    fields = json_fields(text, segments)
    if expected is not None:
        assert [(f.path, f.start, f.end) for f in fields] == expected
    doc = json.loads(text)
    decoder = json.JSONDecoder()
    for f in fields:
        assert text[f.start : f.end] == f.text
        value, end = decoder.raw_decode(text, f.start)
        assert end == f.end and value == f.value and type(value) is type(f.value)
        assert resolve(doc, f.path) == f.value
        got = b"".join(tok.piece(t.id)[t.start : t.end] for t in f.tokens)
        assert got == f.text.encode(), (f, got)
        assert f.confidence == confidence_of(f.tokens) and f.confidence is not None
        assert [t.index for t in f.tokens] == sorted({t.index for t in f.tokens})
    # Streamed one segment at a time: the same fields, each as soon as it is complete.
    stream = FieldStream()
    seen, pos = [], 0
    for seg in segments:
        pos += len(seg.text)
        for f in stream.feed(seg):
            seen.append(f)
            assert f.end <= pos
            if not isinstance(f.value, (int, float)) or isinstance(f.value, bool):
                assert f.end > pos - len(seg.text)  # its last char came in this segment
    seen += stream.finish()
    assert stream.error is None
    assert [x.to_dict() for x in seen] == [x.to_dict() for x in fields]
    return fields


def serialise(value: Any, ws: Callable[[], str], ascii: bool) -> tuple[str, list]:
    """JSON text of `value` with white space from `ws()` between tokens, and where each
    leaf was written: [(pointer, start, end)]."""
    parts: list[str] = []
    leaves: list[tuple[str, int, int]] = []
    size = 0

    def put(s: str) -> None:
        nonlocal size
        parts.append(s)
        size += len(s)

    def walk(v: Any, pointer: str) -> None:
        put(ws())
        if isinstance(v, dict):
            put("{")
            for n, (k, x) in enumerate(v.items()):
                put(ws() + ("," if n else "") + ws() + json.dumps(k, ensure_ascii=ascii))
                put(ws() + ":")
                walk(x, pointer + "/" + k.replace("~", "~0").replace("/", "~1"))
            put(ws() + "}")
        elif isinstance(v, list):
            put("[")
            for n, x in enumerate(v):
                if n:
                    put(ws() + ",")
                walk(x, f"{pointer}/{n}")
            put(ws() + "]")
        else:
            start = size
            put(json.dumps(v, ensure_ascii=ascii))
            leaves.append((pointer, start, size))
        put(ws())

    walk(value, "")
    return "".join(parts), leaves


# -- hypothesis ----------------------------------------------------------------------------


def test_random_json_values_with_random_white_space(tok: Tok) -> None:
    hypothesis = require("hypothesis")
    st = hypothesis.strategies
    keys = st.text(st.sampled_from('ab~/"\\é🙂 x\n'), max_size=4)
    leaves = (
        st.none()
        | st.booleans()
        | st.integers(-(10**12), 10**12)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=8)
    )
    values = st.recursive(
        leaves,
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(keys, kids, max_size=3),
        max_leaves=8,
    )
    spaces = st.sampled_from(["", "", " ", "\n", "\t", "  ", "\r\n"])

    @hypothesis.settings(max_examples=50, deadline=None)
    @hypothesis.given(values, st.booleans(), st.data())
    def run(value: Any, ascii: bool, data: Any) -> None:
        text, where = serialise(value, lambda: data.draw(spaces), ascii)
        check_fields(tok, text, where)

    run()


# -- cases -------------------------------------------------------------------------------


def test_shared_punctuation_token_is_narrowed() -> None:
    """The issue's example: a token `":"` + `"Par` is listed with `"Par` only."""
    text = '{"city":"Paris"}'
    spans = [(0, TokenSpan(0, 10, 0, 6, -0.5)), (6, TokenSpan(1, 11, 0, 6, -1.0)),
             (12, TokenSpan(2, 12, 0, 4, -0.1))]  # fmt: skip
    (field,) = json_fields(text, TokenPlacement.from_tokens(text, spans))
    assert (field.path, field.value, field.text) == ("/city", "Paris", '"Paris"')
    assert field.tokens == (TokenSpan(1, 11, 2, 6, -1.0), TokenSpan(2, 12, 0, 3, -0.1))
    d = field.to_dict()
    assert d["tokens"] == [{"index": 1, "id": 11, "start": 2, "end": 6},
                           {"index": 2, "id": 12, "start": 0, "end": 3}]  # fmt: skip
    assert d["confidence"]["n_tokens"] == 2 and d["alternatives"] is None


def test_pointer_escaping_and_nesting(tok: Tok) -> None:
    text = '{"languages": ["en", "fr"], "a/b": {"m~n": [null, 1.5e3]}, "": true}'
    fields = check_fields(tok, text)
    assert [f.path for f in fields] == [
        "/languages/0", "/languages/1", "/a~1b/m~0n/0", "/a~1b/m~0n/1", "/"
    ]  # fmt: skip


def test_top_level_scalar_and_empty_containers(demo: Tok) -> None:
    assert [(f.path, f.value) for f in check_fields(demo, ' "hi" ')] == [("", "hi")]
    assert check_fields(demo, '{"a": {}, "b": []}') == []
    (num,) = check_fields(demo, "-12.5e-3")
    assert num.value == -12.5e-3


def test_a_token_split_between_segments_is_joined_back(demo: Tok) -> None:
    """A multi-byte character cut between tokens: the aligner emits it once, and the
    field lists each of its tokens once, with the bytes it holds."""
    text = '["🙂é"]'
    (field,) = check_fields(demo, text)
    assert (
        b"".join(demo.piece(t.id)[t.start : t.end] for t in field.tokens)
        == b'"\xf0\x9f\x99\x82\xc3\xa9"'
    )


def test_not_json() -> None:
    bad = [('{"a" 1}', "char 5"), ('{"a": tru}', "char 9"), ("[1,]", "char 3"),
           ('{"a": 1} x', "after the JSON value"), ('{"a": [1', "ends inside")]  # fmt: skip
    for text, where in bad:
        with pytest.raises(StructureError, match=where):
            json_fields(text, [Segment(text, ())])
    stream = FieldStream()
    assert [f.path for f in stream.feed(Segment('{"a": 1, "b": x', ()))] == ["/a"]
    assert "char 14" in (stream.error or "") and stream.feed(Segment("1}", ())) == []
    with pytest.raises(StructureError, match="not the output text"):
        json_fields("[1]", [Segment("[2]", ())])


def test_allowed_values_from_a_schema() -> None:
    schema = {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green"]},
            "ok": {"type": "boolean"},
            "kind": {"anyOf": [{"const": "a"}, {"const": "b"}, {"enum": ["a", "c"]}]},
            "pair": {"prefixItems": [{"const": 1}, {"type": "string"}]},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}},
            "ref": {"$ref": "#/$defs/c"},
        },
    }
    assert allowed_values(schema, ["color"]) == ["red", "green"]
    assert allowed_values(schema, ["ok"]) == [True, False]
    assert allowed_values(schema, ["kind"]) == ["a", "b", "c"]
    assert allowed_values(schema, ["pair", 0]) == [1]
    assert allowed_values(schema, ["pair", 1]) is None
    assert allowed_values(schema, ["tags", 5]) == ["x", "y"]
    assert allowed_values(schema, ["ref"]) is None
    assert allowed_values(schema, ["missing", 0]) is None


class TableScorer:
    """A fake model: each next token's logprob is a fixed function of (context length,
    token id), so the expected probability of any candidate can be written down."""

    def __init__(self, encode: Callable[[str], list[int]]) -> None:
        self.encode = encode
        self.calls: list[tuple[int, str]] = []

    def tokenize(self, text: str) -> list[int]:
        self.calls.append((-1, text))
        return self.encode(text)

    def continuation_logprobs(self, prefix_index: int, token_ids: Sequence[int]) -> list[float]:
        self.calls.append((prefix_index, ""))
        return [-((prefix_index + k + t) % 5) / 4 for k, t in enumerate(token_ids)]


def test_alternatives_math_with_a_known_model(demo: Tok) -> None:
    """Each allowed value is scored along its own tokenization, from the leaf's first
    token on, with the bytes that token had before the leaf and the last one after it."""
    text = '{"color": "green", "ok": true}'
    segments = demo.segments(text)
    scorer = TableScorer(demo.encode)
    schema = {"properties": {"color": {"enum": ["red", "green", "blue"]}}}
    color, ok = json_fields(text, segments, schema=schema, scorer=scorer)
    texts = [t for i, t in scorer.calls if i == -1]
    lead = " "  # the demo tokenizer writes ` "` as one token: its space comes first
    assert texts[:3] == [f'{lead}"red",', f'{lead}"green",', f'{lead}"blue",']
    first = color.tokens[0].index
    for alt in color.alternatives or ():
        ids = demo.encode(f'{lead}"{alt.value}",')
        want = math.exp(sum(-((first + k + t) % 5) / 4 for k, t in enumerate(ids)))
        assert alt.probability == pytest.approx(want)
    assert sum(a.normalized or 0 for a in color.alternatives or ()) == pytest.approx(1.0)
    assert [a.value for a in ok.alternatives or ()] == [True, False]
    assert ok.reason is None and color.reason is None


def test_no_scorer_means_no_alternatives_and_a_reason(demo: Tok) -> None:
    text = '{"ok": false, "n": 3, "c": "x"}'
    ok, n, c = json_fields(text, demo.segments(text), choices={"/c": ["x", "y"]})
    assert ok.alternatives is None and ok.reason == NO_SCORER
    assert c.alternatives is None and c.reason == NO_SCORER
    assert n.alternatives is None and n.reason is None and "reason" not in n.to_dict()


@pytest.fixture(scope="module")
def demo_lm() -> tuple[Any, Any]:
    torch = require("torch")
    transformers = require("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32)
    return model.eval(), torch


def test_alternatives_from_the_demo_model(demo: Tok, demo_lm: tuple[Any, Any]) -> None:
    """A real scorer (the demo model's full distribution, as an engine would supply it):
    a boolean written as one token (` true`) gets, for each value, exactly the softmax
    probability of that value's token at that step, read here straight from the logits."""
    model, torch = demo_lm
    prompt = demo.encode("Answer in JSON.\n")
    text = '{"python": true, "color": "red"}'
    ids = demo.encode(text)

    def logits_after(context: list[int]) -> Any:
        with torch.no_grad():
            out = model(torch.tensor([prompt + context])).logits[0]
        return torch.log_softmax(out.float(), dim=-1)

    class ModelScorer:
        def tokenize(self, s: str) -> list[int]:
            return demo.encode(s)

        def continuation_logprobs(self, prefix_index: int, token_ids: Sequence[int]):
            lp = logits_after(ids[:prefix_index] + list(token_ids))
            start = len(prompt) + prefix_index - 1
            return [lp[start + k, t].item() for k, t in enumerate(token_ids)]

    lp = logits_after(ids)
    aligner = demo.aligner.fresh()
    segments: list[Segment] = []
    for n, i in enumerate(ids):
        segments += aligner.push(i, lp[len(prompt) + n - 1, i].item())
    segments += aligner.finish()
    schema = {"properties": {"color": {"enum": ["red", "blue"]}}}
    flag, color = json_fields(text, segments, schema=schema, scorer=ModelScorer())
    (tok,) = flag.tokens  # ` true`, narrowed to `true`
    dist = lp[len(prompt) + tok.index - 1]
    for alt in flag.alternatives or ():
        (one,) = demo.encode(" " + json.dumps(alt.value))
        assert alt.probability == pytest.approx(math.exp(dist[one].item()), rel=1e-5)
    # The value written: its probability is the product of its own tokens' logprobs.
    chosen = next(a for a in color.alternatives or () if a.value == "red")
    assert [t.id for t in segments_ids(segments, color)] == demo.encode(' "red"')
    want = math.exp(sum(t.logprob for t in segments_ids(segments, color)))
    assert chosen.probability == pytest.approx(want, rel=1e-4)
    assert 0 < chosen.normalized < 1  # type: ignore[operator]


def segments_ids(segments: list[Segment], field: Any) -> list[TokenSpan]:
    """The whole tokens (not narrowed) behind a field, from the segments."""
    wanted = {t.index for t in field.tokens}
    return [t for s in segments for t in s.tokens if t.index in wanted]
