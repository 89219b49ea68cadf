"""Stop strings on streamed segments, checked against `text.find(stop)` on the full text.

Segments come from the real aligner over GPT-2's tokenizer.json, on text in a small
alphabet (so stop strings match often), sometimes with tokens dropped so that invalid
UTF-8 (U+FFFD, segments that cannot be split by character) shows up too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tokentrail import Aligner, Segment, TokenSpan, load_vocab
from tokentrail.stops import StopMatcher, merge_spans, split_segment, splittable
from tokentrail.vocab import Vocab

ALPHABET = "ab é🙂龘\n,"


@pytest.fixture(scope="module")
def gpt2(corpus: Path) -> tuple[Vocab, object]:
    from tokenizers import Tokenizer

    path = corpus / "tokenizers" / "gpt2" / "tokenizer.json"
    if not path.is_file():
        pytest.skip(f"{path} missing from corpus")
    return load_vocab(path), Tokenizer.from_file(str(path))


def span_bytes(vocab: Vocab, spans: list[TokenSpan] | tuple[TokenSpan, ...]) -> bytes:
    return b"".join((vocab.pieces[t.id] or b"")[t.start : t.end] for t in spans)


def longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Brute force: the longest suffix of `text` that is a proper prefix of a stop."""
    best = 0
    for stop in stops:
        for k in range(1, len(stop)):
            if text.endswith(stop[:k]):
                best = max(best, k)
    return best


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_matches_text_find_on_the_full_text(
    gpt2: tuple[Vocab, object], data: st.DataObject
) -> None:
    vocab, tok = gpt2
    text = data.draw(st.text(alphabet=ALPHABET, max_size=30), label="text")
    ids = tok.encode(text).ids  # type: ignore[attr-defined]
    drop = data.draw(st.sets(st.integers(0, max(len(ids) - 1, 0)), max_size=2), label="drop")
    ids = [i for n, i in enumerate(ids) if n not in drop]
    pieces = st.text(alphabet=ALPHABET, min_size=1, max_size=4)
    if text:
        start = data.draw(st.integers(0, len(text) - 1))
        pieces = pieces | st.just(text[start : start + data.draw(st.integers(1, 5))])
    stops = data.draw(st.lists(pieces, min_size=1, max_size=3), label="stops")

    aligner = Aligner(vocab)
    matcher = StopMatcher(stops)
    fed: list[Segment] = []
    released: list[Segment] = []
    seen = ""
    pushes = [aligner.push(i) for i in ids] + [aligner.finish()]
    match = None
    for segments in pushes:
        fed.extend(segments)
        seen += "".join(s.text for s in segments)
        out, match = matcher.feed(segments)
        released.extend(out)
        out_text = "".join(s.text for s in released)
        hits = sorted((seen.find(s), len(s), s) for s in stops if s in seen)
        if hits:
            pos, _, stop = hits[0]
            assert match is not None and match.stop == stop
            assert out_text == seen[:pos]
            event("stop string matched")
            break
        assert match is None
        # Only what could still start a stop string is held back.
        assert matcher.held_text == seen[len(out_text) :]
        keep = longest_stop_prefix_suffix(seen, stops)
        assert len(matcher.held_text) >= keep
        if "\ufffd" not in seen:
            assert len(matcher.held_text) == keep
        else:
            event("invalid UTF-8 in the stream")
    else:
        released.extend(matcher.flush())
        assert "".join(s.text for s in released) == seen

    # Tokens: the released text and the stop string are made of exactly the fed bytes.
    stop_spans = match.tokens if match else ()
    indices = {t.index for s in fed for t in s.tokens}
    assert indices <= {t.index for s in released for t in s.tokens} | {t.index for t in stop_spans}
    out_spans = merge_spans(released)
    if "\ufffd" not in seen:
        out_bytes = span_bytes(vocab, out_spans)
        assert out_bytes.decode("utf-8") == "".join(s.text for s in released)
        assert out_bytes + span_bytes(vocab, stop_spans) == span_bytes(vocab, merge_spans(fed))
        if match:
            assert span_bytes(vocab, stop_spans).startswith(match.stop.encode())


def seg(text: str, *spans: tuple[int, int, int, int]) -> Segment:
    return Segment(text, tuple(TokenSpan(i, tid, a, b) for i, tid, a, b in spans))


def test_split_segment_cuts_a_token_at_the_byte_of_the_character() -> None:
    s = seg("hé🙂!", (0, 10, 0, 3), (1, 11, 0, 5))  # "hé" = 3 bytes, "🙂!" = 5 bytes
    assert splittable(s)
    parts = split_segment(s, 1)
    assert parts is not None
    left, right = parts
    assert (left.text, right.text) == ("h", "é🙂!")
    assert [(t.index, t.start, t.end) for t in left.tokens] == [(0, 0, 1)]
    assert [(t.index, t.start, t.end) for t in right.tokens] == [(0, 1, 3), (1, 0, 5)]
    assert merge_spans([left, right]) == list(s.tokens)


def test_unsplittable_segments_are_held_whole() -> None:
    bad = seg("x\ufffdab", (0, 5, 0, 1), (1, 6, 0, 1), (2, 7, 0, 2))
    assert not splittable(bad)
    assert split_segment(bad, 2) is None
    m = StopMatcher(["abc"])
    out, match = m.feed([bad])
    assert out == [] and match is None  # "ab" may start "abc"; the segment can't be cut
    out, match = m.feed([seg("z", (3, 8, 0, 1))])
    assert match is None
    assert "".join(s.text for s in out) == "x\ufffdabz"


def test_stop_inside_an_unsplittable_segment_still_trims_the_text() -> None:
    bad = seg("\ufffdxSTOPy", (0, 5, 0, 1), (1, 6, 0, 6))
    out, match = StopMatcher(["STOP"]).feed([bad])
    assert "".join(s.text for s in out) == "\ufffdx"
    assert match is not None and match.stop == "STOP"
    assert [t.index for t in match.tokens] == [0, 1]


def test_bad_stop_strings_are_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopMatcher([""])
    with pytest.raises(TypeError, match="str"):
        StopMatcher([b"x"])  # type: ignore[list-item]


def test_shorter_stop_wins_at_the_same_position() -> None:
    m = StopMatcher(["abc", "ab"])
    out, match = m.feed([seg("xabc", (0, 1, 0, 4))])
    assert match is not None and match.stop == "ab"
    assert [s.text for s in out] == ["x"]
    with pytest.raises(RuntimeError):
        m.feed([seg("c", (1, 2, 0, 1))])
