"""Confidence-weighted answers and early stop (issue #31, part 5).

The rules (`tokentrail.output.vote`) are checked as invariants with hypothesis; the
server's ``tokentrail.vote``, ``ballot``, ``stopped_by`` and ``usage.tokentrail`` on a
real `tokentrail serve` (the demo model) through the official `openai` client, each
against what the response itself reports: a ballot's confidence against its own
tokens' logprobs, a group against its choices' own texts, a stopped choice against the
same seed's run without early stop.
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers.env import require
from tokentrail.output.vote import Ballot, EarlyStop, normalise, tally, vote

openai = require("openai")
require("mlx_lm")
require("uvicorn")

from tests.helpers.responses import ext  # noqa: E402
from tests.helpers.servers import Server, start_server  # noqa: E402

MSG = [{"role": "user", "content": "Is the sky blue?"}]
PROMPT = "The capital of France is"

# -- the rules, as invariants -------------------------------------------------------------------


def _answer(text: str) -> str:
    """The normalisation, written out again for the oracle: whitespace collapsed,
    casefolded, trailing punctuation and spaces dropped."""
    out = " ".join(text.split()).casefold()
    while out and (out[-1] == " " or unicodedata.category(out[-1])[0] == "P"):
        out = out[:-1]
    return out


ballots = st.lists(
    st.tuples(st.sampled_from(["Paris", " paris.", "PARIS!", "Lyon", "lyon ", "", "{\"a\": 1}",
                               "{ \"a\" : 1.0 }", "[1, 2]"]),
              st.none() | st.floats(0, 1), st.booleans()),
    min_size=1, max_size=12,
)  # fmt: skip


def _key(b: Ballot) -> str:
    return json.dumps(b.answer, sort_keys=True)


@given(ballots, st.sampled_from(["confidence", "majority"]))
def test_tally_groups_counts_sums_and_winner(items: list[Any], rule: str) -> None:
    bs = [Ballot(i, text, conf, stopped=stop) for i, (text, conf, stop) in enumerate(items)]
    result = tally(bs, rule)
    voters = [b for b in bs if not b.stopped]
    assert list(result.stopped) == [b.index for b in bs if b.stopped]
    # the groups partition the voters, each voter in the group of its own answer
    seen = sorted(i for g in result.groups for i in g.choices)
    assert seen == [b.index for b in voters]
    for g in result.groups:
        assert g.count == len(g.choices)
        assert len({_key(bs[i]) for i in g.choices}) == 1
        assert math.isclose(g.confidence, sum(bs[i].confidence or 0.0 for i in g.choices))
    assert len(result.groups) == len({_key(b) for b in voters})
    if not voters:
        assert result.winner is None
        return
    win = result.winner
    assert win is not None
    key = (lambda g: (g.confidence, g.count)) if rule == "confidence" else (
        lambda g: (g.count, g.confidence))  # fmt: skip
    assert all(key(win) >= key(g) for g in result.groups)
    assert result.choice in win.choices


def test_answers_normalise_and_json_compares_values() -> None:
    assert normalise("  The   Eiffel\tTower!? ") == "the eiffel tower"
    assert normalise("Straße.") == "strasse"
    assert normalise("4.") == normalise("4") == "4"
    result = vote(['{"a": 1, "b": [true]}', '{"b":[true],"a":1.0}', '{"a": true, "b": [1]}'])
    assert [g.choices for g in result.groups] == [[0, 1], [2]]
    assert result.groups[0].answer == {"a": 1, "b": [True]}
    # a JSON-constrained reply compares scalars as values too
    assert len(vote(["1", "1.0"], json_reply=True).groups) == 1
    assert len(vote(["1", "1.0"]).groups) == 2
    with pytest.raises(ValueError):
        vote(["a"], rule="loudest")


def test_early_stop_needs_a_finished_reply_and_a_full_window() -> None:
    stop = EarlyStop(2, window=3)
    assert not any(stop.observe(0, math.log(0.01)) for _ in range(5))  # nobody finished yet
    for _ in range(3):
        assert not stop.observe(1, math.log(0.5))
    stop.finished(1)
    assert stop.threshold == pytest.approx(0.5)
    assert stop.observe(0, math.log(0.01))
    stop.stopped(0, 7)
    assert stop.usage() == {"early_stopped": 1, "saved_tokens_at_most": 7}


def test_batch_generate_early_stop_cuts_the_same_replies() -> None:
    """The library's early stop: the same seeds' replies, the stopped ones cut short."""
    import tokentrail

    model, tokenizer = tokentrail.load()
    kw = {"n": 8, "temp": 1.0, "seed": 3}
    full = tokentrail.batch_generate(model, tokenizer, [PROMPT], 64, **kw).completions
    cut = tokentrail.batch_generate(model, tokenizer, [PROMPT], 64, early_stop=True,
                                    **kw).completions  # fmt: skip
    stopped = [i for i, c in enumerate(cut) if c.stopped_by == "early_stop"]
    assert stopped, "no choice was stopped: pick another seed"
    for i in stopped:
        assert cut[i].finish_reason == "stop"
        assert len(cut[i].token_ids) < len(full[i].token_ids)
        assert cut[i].token_ids == full[i].token_ids[: len(cut[i].token_ids)]
    assert all(c.stopped_by is None for c in full)
    result = vote(cut)
    assert list(result.stopped) == stopped
    assert sorted(i for g in result.groups for i in g.choices) == [
        i for i in range(8) if i not in stopped
    ]
    with pytest.raises(ValueError, match="early_stop"):
        tokentrail.batch_generate(model, tokenizer, [PROMPT], 4, early_stop=True)


# -- over HTTP ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(None, tmp_path_factory.mktemp("logs") / "vote.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _tokens(choice_ext: dict[str, Any]) -> list[dict[str, Any]]:
    """A choice's tokens, each once, from its segments."""
    out: dict[int, dict[str, Any]] = {}
    for seg in choice_ext["segments"]:
        for t in seg["tokens"]:
            out.setdefault(t["index"], t)
    return [out[i] for i in sorted(out)]


def _check_vote(extension: dict[str, Any], texts: list[str], rule: str,
                json_reply: bool = False) -> None:  # fmt: skip
    """`tokentrail.vote` against the choices' own texts and ballots."""
    exts = extension["choices"]
    found = extension["vote"]
    assert found["rule"] == rule
    stopped = [i for i, e in enumerate(exts) if e.get("stopped_by") == "early_stop"]
    assert found["stopped"] == stopped
    for i, e in enumerate(exts):
        # the ballot's confidence is the geometric mean of the choice's own tokens
        lps = [t["logprob"] for t in _tokens(e)]
        assert e["ballot"]["confidence"] == pytest.approx(math.exp(sum(lps) / len(lps)))
        answer = json.loads(texts[i]) if json_reply else _answer(texts[i])
        assert e["ballot"]["answer"] == (None if i in stopped else answer)
    groups = found["groups"]
    assert sorted(i for g in groups for i in g["choices"]) == [
        i for i in range(len(exts)) if i not in stopped
    ]
    for g in groups:
        assert g["count"] == len(g["choices"])
        assert all(exts[i]["ballot"]["answer"] == g["answer"] for i in g["choices"])
        assert g["confidence"] == pytest.approx(
            sum(exts[i]["ballot"]["confidence"] for i in g["choices"])
        )
    assert len({json.dumps(g["answer"], sort_keys=True) for g in groups}) == len(groups)
    first = ("confidence", "count") if rule == "confidence" else ("count", "confidence")
    ranks = [(g[first[0]], g[first[1]], -g["choices"][0]) for g in groups]
    assert ranks == sorted(ranks, reverse=True)  # the winner first, ties as documented
    win = groups[0]
    assert found["winner"]["answer"] == win["answer"]
    assert found["winner"]["choice"] in win["choices"]
    best = max(exts[i]["ballot"]["confidence"] for i in win["choices"])
    assert exts[found["winner"]["choice"]]["ballot"]["confidence"] == best


@pytest.mark.parametrize("rule", ["confidence", "majority"])
def test_vote_on_free_text(server: Server, client: Any, rule: str) -> None:
    r = client.completions.create(
        model=server.model, prompt=PROMPT, n=6, max_tokens=12, temperature=1.0, seed=11,
        extra_body={"tokentrail": {"vote": rule}},
    )  # fmt: skip
    _check_vote(ext(r), [c.text for c in r.choices], rule)


def test_vote_groups_equal_answers(server: Server, client: Any) -> None:
    """Eight replies among "Yes", "yes." and "No": at most two answers, so some repeat."""
    r = client.chat.completions.create(
        model=server.model, messages=MSG, n=8, max_tokens=8, temperature=1.0, seed=5,
        extra_body={"structured_outputs": {"choice": ["Yes", "yes.", "No"]},
                    "tokentrail": {"vote": "majority"}},
    )  # fmt: skip
    texts = [c.message.content for c in r.choices]
    _check_vote(ext(r), texts, "majority")
    groups = ext(r)["vote"]["groups"]
    assert {g["answer"] for g in groups} <= {"yes", "no"}
    assert sum(g["count"] for g in groups) == 8


def test_vote_compares_json_values(server: Server, client: Any) -> None:
    schema = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"],
              "additionalProperties": False}  # fmt: skip
    r = client.chat.completions.create(
        model=server.model, messages=MSG, n=6, max_tokens=24, temperature=1.0, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        extra_body={"tokentrail": {"vote": "confidence"}},
    )  # fmt: skip
    texts = [c.message.content for c in r.choices]
    _check_vote(ext(r), texts, "confidence", json_reply=True)
    assert all(g["answer"] in ({"x": 1}, {"x": 2}) for g in ext(r)["vote"]["groups"])


def _ids(choice_ext: dict[str, Any]) -> list[int]:
    return [t["id"] for t in _tokens(choice_ext)]


def test_early_stop_ends_weak_choices_and_reports_the_room_saved(
    server: Server, client: Any
) -> None:
    max_tokens = 64
    body = {"model": server.model, "prompt": PROMPT, "n": 8, "max_tokens": max_tokens,
            "temperature": 1.0, "seed": 3}  # fmt: skip
    plain = client.completions.create(**body, extra_body={"tokentrail": {"vote": "confidence"}})
    early = client.completions.create(
        **body, extra_body={"tokentrail": {"vote": "confidence", "early_stop": True}}
    )
    exts, plain_exts = ext(early)["choices"], ext(plain)["choices"]
    stopped = [i for i, e in enumerate(exts) if e.get("stopped_by") == "early_stop"]
    assert stopped, "no choice was stopped: pick another seed"
    assert all("stopped_by" not in e for e in plain_exts)
    saved = 0
    for i in stopped:
        assert early.choices[i].finish_reason == "stop"
        mine, full = _ids(exts[i]), _ids(plain_exts[i])
        assert len(mine) < len(full)
        assert mine == full[: len(mine)]  # the same seed's reply, cut short
        saved += len(full) - len(mine)
    # usage counts the tokens computed, and the room the stopped choices had left
    assert early.usage.completion_tokens == sum(len(_ids(e)) for e in exts)
    assert plain.usage.completion_tokens == sum(len(_ids(e)) for e in plain_exts)
    extra = early.usage.model_extra["tokentrail"]
    assert extra["early_stopped"] == len(stopped)
    assert extra["saved_tokens_at_most"] == sum(max_tokens - len(_ids(exts[i])) for i in stopped)
    assert 0 < saved <= extra["saved_tokens_at_most"]
    assert "tokentrail" not in (plain.usage.model_extra or {})
    _check_vote(ext(early), [c.text for c in early.choices], "confidence")


def test_streamed_vote_comes_after_every_choice(server: Server, client: Any) -> None:
    chunks = list(client.chat.completions.create(
        model=server.model, messages=MSG, n=4, max_tokens=48, temperature=1.0, seed=3,
        stream=True, stream_options={"include_usage": True},
        extra_body={"tokentrail": {"vote": "confidence", "early_stop": True}},
    ))  # fmt: skip
    texts = ["" for _ in range(4)]
    exts: list[dict[str, Any]] = [{"segments": []} for _ in range(4)]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            e = ext(chunk)
            exts[c.index]["segments"] += e["segments"]
            if c.finish_reason is not None:
                exts[c.index]["ballot"] = e["ballot"]
                if "stopped_by" in e:
                    exts[c.index]["stopped_by"] = e["stopped_by"]
                    assert c.finish_reason == "stop"
    voted = [c for c in chunks if not c.choices and "tokentrail" in (c.model_extra or {})]
    assert len(voted) == 1
    assert chunks[-1].usage is not None and chunks[-2] is voted[0]
    _check_vote({"choices": exts, "vote": ext(voted[0])["vote"]}, texts, "confidence")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 1, "tokentrail": {"vote": "confidence"}}, "tokentrail.vote"),
        ({"tokentrail": {"vote": "majority"}}, "tokentrail.vote"),
        ({"n": 2, "tokentrail": {"early_stop": True}}, "tokentrail.early_stop"),
    ],
)
def test_vote_needs_choices(server: Server, client: Any, extra: dict[str, Any],
                            param: str) -> None:  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2,
                                  extra_body=extra)  # fmt: skip
    assert info.value.body["param"] == param
