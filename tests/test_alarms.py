"""Alarms (issue #31, part 1): segments and JSON fields whose confidence is below P are
flagged on the record / chunk that completes them, and "stop" ends the reply there.

The oracle is the reply itself: every unit the response reports (``tokentrail.segments``,
``tokentrail.fields``, each with its confidence) is alarmed exactly when its reported
probability is below P. "stop" is checked by counting: the tokens the reply used end
with the alarmed unit's record, they are a prefix of the same greedy reply without the
stop, and the library's engine steps (counted by wrapping its step iterator) are no more
than the records. Real parts throughout: the demo model, llguidance, a real
``tokentrail serve`` and the official ``openai`` client.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.env import require

openai = require("openai", "the official client reads the server's responses")
httpx = require("httpx")
require("llguidance", "constraints compile through llguidance")

import tokentrail.engines.mlx.steps as mlx_steps_module  # noqa: E402
from tests.helpers.servers import Server, pick_model_dir, start_server  # noqa: E402
from tokentrail.errors import ActionError  # noqa: E402
from tokentrail.generate import load, stream_generate  # noqa: E402
from tokentrail.output.alarm import Alarm, AlarmWatch  # noqa: E402

MSG = [{"role": "user", "content": "Tell me about Paris."}]
PROMPT = "Once upon a time"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "big": {"type": "boolean"},
        "mood": {"enum": ["calm", "busy"]},
        "rank": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "big", "mood", "rank"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "place", "schema": SCHEMA, "strict": True},
}
SERVED = ["tokentrail-demo"]
P = 0.5  # the demo model's replies have units on both sides of it (checked below)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = pick_model_dir(tmp_path_factory)
    srv = start_server(model_dir, tmp_path_factory.mktemp("logs") / "alarm.log")
    SERVED[0] = srv.model
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def demo() -> tuple[Any, Any]:
    return load()


def _ext(obj: Any) -> dict[str, Any]:
    return obj.model_extra["tokentrail"]


def _prob(unit: dict[str, Any]) -> float | None:
    conf = unit["confidence"]
    if conf is None:
        return None
    return conf["calibrated"] if "calibrated" in conf else conf["probability"]


def _below(units: list[dict[str, Any]], p: float) -> list[int]:
    return [i for i, u in enumerate(units) if (v := _prob(u)) is not None and v < p]


def _request(client: Any, kind: str, alarm: dict[str, Any], stream: bool, **kw: Any) -> Any:
    body = {"tokentrail": {"alarm": alarm}}
    if stream:
        kw["stream_options"] = {"include_usage": True}
    if kind == "chat":
        return client.chat.completions.create(
            model=SERVED[0], messages=MSG, max_tokens=kw.pop("max_tokens", 40), stream=stream,
            extra_body=body, **kw,
        )  # fmt: skip
    return client.completions.create(
        model=SERVED[0], prompt=PROMPT, max_tokens=kw.pop("max_tokens", 40), stream=stream,
        extra_body=body, **kw,
    )  # fmt: skip


def _chunks(stream: Any) -> tuple[list[dict[str, Any]], list[Any], Any]:
    """The extension of each chunk that has a choice, those chunks, and the usage."""
    exts, chunks, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            exts.append(_ext(chunk))
            chunks.append(chunk)
    return exts, chunks, usage


# -- segments ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_segment_alarms_are_exactly_the_segments_below_p(client: Any, kind: str) -> None:
    whole = _request(client, kind, {"below": P}, stream=False)
    ext = _ext(whole)
    segments = ext["segments"]
    expected = _below(segments, P)
    assert 0 < len(expected) < len(segments), "pick a P with units on both sides"
    assert [a["index"] for a in ext["alarms"]] == expected
    for a in ext["alarms"]:
        assert a == {"on": "segment", "index": a["index"], "value": _prob(segments[a["index"]]),
                     "below": P}  # fmt: skip
    assert "stopped_by" not in ext

    # streamed: each alarm rides on the chunk whose segment it names
    exts, _, _ = _chunks(_request(client, kind, {"below": P}, stream=True))
    seen = 0
    streamed = []
    for e in exts:
        mine = list(range(seen, seen + len(e["segments"])))
        seen += len(e["segments"])
        flagged = [mine[i] for i in _below(e["segments"], P)]
        assert [a["index"] for a in e.get("alarms", [])] == flagged
        streamed += flagged
    assert streamed == expected  # greedy: the same reply


def test_an_alarm_at_zero_or_one(client: Any) -> None:
    """P = 0 flags nothing; P = 1 flags every segment that has a probability under 1."""
    none = _ext(_request(client, "completions", {"below": 0.0}, stream=False))
    assert none["alarms"] == []
    every = _ext(_request(client, "completions", {"below": 1.0}, stream=False))
    assert [a["index"] for a in every["alarms"]] == _below(every["segments"], 1.0)
    assert every["alarms"]


@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_computes_no_token_after_the_alarmed_segment(
    client: Any, kind: str, stream: bool
) -> None:
    plain = _ext(_request(client, kind, {"below": P}, stream=False))
    first = plain["alarms"][0]["index"]
    # the segment's last token is the last one computed
    last_token = max(t["index"] for t in plain["segments"][first]["tokens"])
    r = _request(client, kind, {"below": P, "action": "stop"}, stream=stream)
    if stream:
        exts, chunks, usage = _chunks(r)
        finish = chunks[-1].choices[0].finish_reason
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
        segments = [s for e in exts for s in e["segments"]]
        alarms = [a for e in exts for a in e.get("alarms", [])]
        assert exts[-1]["alarms"] == alarms  # only the last chunk alarms
        assert exts[-1]["stopped_by"] == "alarm"
        assert exts[-1]["token"]["index"] == last_token
    else:
        ext, usage = _ext(r), r.usage
        finish = r.choices[0].finish_reason
        segments, alarms = ext["segments"], ext["alarms"]
        assert ext["stopped_by"] == "alarm"
    assert finish == "stop"
    assert [a["index"] for a in alarms] == [first]
    assert segments == plain["segments"][: first + 1]
    assert usage.completion_tokens == last_token + 1


# -- fields --------------------------------------------------------------------------------


def _field_p(client: Any) -> tuple[float, list[dict[str, Any]]]:
    """A P between the fields' probabilities of the greedy JSON reply (some below,
    some not), and those fields."""
    r = client.chat.completions.create(
        model=SERVED[0], messages=MSG, max_tokens=80, response_format=RESPONSE_FORMAT
    )
    fields = _ext(r)["fields"]
    probs = sorted(p for f in fields if (p := _prob(f)) is not None)
    assert len(set(probs)) >= 2, fields
    mid = len(probs) // 2
    return (probs[mid - 1] + probs[mid]) / 2 if probs[mid - 1] < probs[mid] else probs[-1], fields


def test_field_alarms_whole_and_streamed(client: Any) -> None:
    p, fields = _field_p(client)
    expected = [fields[i]["path"] for i in _below(fields, p)]
    assert 0 < len(expected) < len(fields)
    r = _request(client, "chat", {"below": p, "on": "field"}, False, max_tokens=80,
                 response_format=RESPONSE_FORMAT)  # fmt: skip
    ext = _ext(r)
    assert [a["path"] for a in ext["alarms"]] == expected
    assert all(a["on"] == "field" and "index" not in a for a in ext["alarms"])
    assert {a["path"]: a["value"] for a in ext["alarms"]} == {
        f["path"]: _prob(f) for f in ext["fields"] if f["path"] in expected
    }
    exts, _, _ = _chunks(_request(client, "chat", {"below": p, "on": "field"}, True,
                                  max_tokens=80, response_format=RESPONSE_FORMAT))  # fmt: skip
    for e in exts:  # each on the chunk that completes its field
        here = e.get("fields", [])
        flagged = [here[i]["path"] for i in _below(here, p)]
        assert [a["path"] for a in e.get("alarms", [])] == flagged
    assert [a["path"] for e in exts for a in e.get("alarms", [])] == expected
    # "both": the segments' alarms and the fields' together
    both = _ext(_request(client, "chat", {"below": p, "on": "both"}, False, max_tokens=80,
                         response_format=RESPONSE_FORMAT))  # fmt: skip
    assert [a["index"] for a in both["alarms"] if a["on"] == "segment"] == _below(
        both["segments"], p
    )
    assert [a["path"] for a in both["alarms"] if a["on"] == "field"] == expected


def test_field_stop_ends_the_reply_with_that_field(client: Any) -> None:
    p, fields = _field_p(client)
    first = fields[_below(fields, p)[0]]
    exts, chunks, usage = _chunks(_request(
        client, "chat", {"below": p, "on": "field", "action": "stop"}, True, max_tokens=80,
        response_format=RESPONSE_FORMAT,
    ))  # fmt: skip
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert exts[-1]["stopped_by"] == "alarm"
    assert [a["path"] for a in exts[-1]["alarms"]] == [first["path"]]
    assert [f["path"] for e in exts for f in e.get("fields", [])][-1] == first["path"]
    # the record that completed the field is the last token computed
    assert usage.completion_tokens == exts[-1]["token"]["index"] + 1 == len(chunks)
    assert max(t["index"] for t in first["tokens"]) <= exts[-1]["token"]["index"]


def test_alarm_on_fields_needs_fields(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _request(client, "chat", {"below": 0.5, "on": "field"}, stream=False)
    assert e.value.body["param"] == "tokentrail.alarm.on"
    with pytest.raises(openai.BadRequestError) as e:
        _request(client, "completions", {"below": 0.5, "action": "halt"}, stream=False)
    assert e.value.body["param"] == "tokentrail.alarm.action"
    with pytest.raises(openai.BadRequestError) as e:  # streamed: before any chunk
        _request(client, "completions", {"below": 0.5, "on": "field"}, stream=True)
    assert e.value.body["param"] == "tokentrail.alarm.on"


# -- library -------------------------------------------------------------------------------


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the engine steps `stream_generate` draws (mlx-lm's step iterator, wrapped
    where the library takes it from)."""
    drawn = [0]
    steps = mlx_steps_module.mlx_steps

    def counting(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for step in steps(*args, **kwargs):
            drawn[0] += 1
            yield step

    monkeypatch.setattr(mlx_steps_module, "mlx_steps", counting)
    return drawn


def test_library_alarms_and_stop(demo: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = demo
    drawn = _counted(monkeypatch)
    flagged = list(stream_generate(model, tok, PROMPT, max_tokens=40, alarm={"below": P}))
    plain_steps = drawn[0]
    index = 0
    first = None
    for r in flagged:
        mine = []
        if r.text or r.last_segment_tokens:
            if r.confidence is not None and r.confidence.probability < P:
                mine.append(index)
            index += 1
        assert [a.index for a in r.alarms] == mine
        if mine and first is None:
            first = r
    assert first is not None and plain_steps == len(flagged)

    drawn[0] = 0
    stopped = list(stream_generate(
        model, tok, PROMPT, max_tokens=40, alarm=Alarm(below=P, action="stop")
    ))  # fmt: skip
    last = stopped[-1]
    assert (last.finish_reason, last.stopped_by) == ("stop", "alarm")
    assert last.generation_tokens == first.generation_tokens
    assert drawn[0] == len(stopped) == first.generation_tokens  # no step past the unit
    assert [r.text for r in stopped] == [r.text for r in flagged[: len(stopped)]]
    assert last.to_dict()["stopped_by"] == "alarm"


def test_library_field_alarm(demo: tuple[Any, Any]) -> None:
    model, tok = demo
    rs = list(stream_generate(model, tok, MSG, max_tokens=80, json_schema=SCHEMA,
                              alarm={"below": 1.0, "on": "field"}))  # fmt: skip
    for r in rs:
        assert [a.path for a in r.alarms] == [
            f.path for f in r.fields or () if f.confidence is not None
            and f.confidence.probability < 1.0
        ]
    assert sum(len(r.alarms) for r in rs) > 0


def test_library_bad_alarms_name_the_key(demo: tuple[Any, Any]) -> None:
    model, tok = demo
    for bad, key in (
        ({"below": 1.5}, "alarm.below"),
        ({"below": True}, "alarm.below"),
        ({"below": float("nan")}, "alarm.below"),
        ({"on": "segment"}, "alarm.below"),
        ({"below": 0.5, "on": "word"}, "alarm.on"),
        ({"below": 0.5, "action": "halt"}, "alarm.action"),
        ({"below": 0.5, "loud": True}, "alarm.loud"),
        ({"below": 0.5, "on": "field"}, "alarm.on"),  # no fields in a plain reply
    ):
        with pytest.raises(ActionError) as e:
            stream_generate(model, tok, PROMPT, max_tokens=4, alarm=bad)
        assert e.value.param == key, bad
        assert isinstance(e.value, ValueError)


@pytest.fixture(scope="module")
def records(demo: tuple[Any, Any]) -> list[Any]:
    model, tok = demo
    return [r.output for r in stream_generate(model, tok, PROMPT, max_tokens=40, top_logprobs=3)]


@settings(max_examples=60, deadline=None)
@given(p=st.floats(0.0, 1.0))
def test_alarms_are_the_segments_below_any_p(records: list[Any], p: float) -> None:
    watch = AlarmWatch(Alarm(p))
    got = [h.index for out in records for h in watch.check(out)]
    units = [out for out in records if out.text or out.tokens]
    assert got == [
        i for i, out in enumerate(units)
        if out.confidence is not None and out.confidence.probability < p
    ]  # fmt: skip


# -- the proxy -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def proxy(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`serve --upstream` in front of the module's own server (the demo model)."""
    log = tmp_path_factory.mktemp("logs") / "proxy.log"
    srv = start_server(None, log, "--upstream", server.url, "--tokenizer", str(server.model_dir))
    yield srv
    srv.stop()


def test_alarms_through_the_proxy(proxy: Server) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=300)
    body = {"model": proxy.model, "prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    r = client.completions.create(**body, extra_body={"tokentrail": {"alarm": {"below": P}}})
    ext = _ext(r)
    expected = _below(ext["segments"], P)
    assert expected and [a["index"] for a in ext["alarms"]] == expected
    first = expected[0]
    last_token = max(t["index"] for t in ext["segments"][first]["tokens"])
    stopped = client.completions.create(
        **body, extra_body={"tokentrail": {"alarm": {"below": P, "action": "stop"}}}
    )
    sx = _ext(stopped)
    assert (stopped.choices[0].finish_reason, sx["stopped_by"]) == ("stop", "alarm")
    assert sx["segments"] == ext["segments"][: first + 1]
    assert stopped.usage.completion_tokens == last_token + 1


def test_upstream_chat_says_alarms_are_not_supported(
    server: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log = tmp_path_factory.mktemp("logs") / "proxy-chat.log"
    srv = start_server(
        None, log, "--upstream", server.url, "--tokenizer", str(server.model_dir), "--upstream-chat"
    )
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=srv.model, messages=MSG, max_tokens=8,
                extra_body={"tokentrail": {"alarm": {"below": 0.5}}},
            )  # fmt: skip
        assert e.value.body["param"] == "tokentrail.alarm"
    finally:
        srv.stop()


def _first_wide_unit(demo: tuple[Any, Any]) -> tuple[float, str, list[Any]]:
    """A P whose first flagged segment is a record of two or more characters, that
    record's text, and the greedy reply's responses (flagging at P)."""
    model, tok = demo
    rs = list(stream_generate(model, tok, PROMPT, max_tokens=40))
    lowest = 1.0
    for r in rs:
        p = r.confidence.probability if r.confidence is not None else 1.0
        if p < lowest and len(r.text) >= 2:
            return (p + lowest) / 2, r.text, rs
        lowest = min(lowest, p)
    pytest.skip("the greedy reply has no record to hold back text from")


def test_stop_with_text_held_back(demo: tuple[Any, Any]) -> None:
    """Text a stop string may still start is held when the alarm stops the reply: it
    is not emitted, its tokens are the final response's `stop_tokens`."""
    model, tok = demo
    p, text, plain = _first_wide_unit(demo)
    stop = text[-1] + "\u2603"  # never matches, but holds the record's last character
    rs = list(stream_generate(model, tok, PROMPT, max_tokens=40, stop=[stop],
                              alarm={"below": p, "action": "stop"}))  # fmt: skip
    last = rs[-1]
    assert (last.finish_reason, last.stopped_by, last.stop_string) == ("stop", "alarm", None)
    assert last.text == text[:-1]
    assert [r.text for r in rs[:-1]] == [r.text for r in plain[: len(rs) - 1]]
    assert [t.index for t in last.stop_tokens] == [last.generation_tokens - 1]
    assert last.to_dict()["stop_tokens"]


def test_stop_finishes_the_channels(demo: tuple[Any, Any]) -> None:
    """With a reasoning format, text the splitter still held when the alarm stopped
    the reply comes out as the last part (and is watched too); the channels end."""
    model, tok = demo
    p, text, _ = _first_wide_unit(demo)
    markers = (text[-1] + "\u2603", "\u2604")
    rs = list(stream_generate(model, tok, PROMPT, max_tokens=40, reasoning=markers,
                              alarm={"below": p, "action": "stop"}))  # fmt: skip
    last = rs[-1]
    assert last.stopped_by == "alarm"
    assert [c.text for c in last.channels] == [text[:-1], text[-1]]
    parts = [c for r in rs for c in r.channels]
    assert [a.index for a in last.alarms] == [
        i for i, c in enumerate(parts) if c.confidence.probability < p
    ][-2:]
    assert last.content == "".join(c.text for c in parts) and last.reasoning == ""


def test_batch_generate_alarms(demo: tuple[Any, Any]) -> None:
    """Each sequence of a batch has its own alarm stage: its flagged segments are those
    below P, and "stop" ends each one at its own first."""
    from tokentrail.batch import batch_generate

    model, tok = demo
    prompts = [PROMPT, "The capital of France is"]
    flagged = batch_generate(model, tok, prompts, max_tokens=30, alarm={"below": P})
    stopped = batch_generate(model, tok, prompts, max_tokens=30,
                             alarm={"below": P, "action": "stop"})  # fmt: skip
    for c, s in zip(flagged.completions, stopped.completions, strict=True):
        below = [i for i, seg in enumerate(c.segments)
                 if seg.confidence is not None and seg.confidence.probability < P]  # fmt: skip
        assert below and [a.index for a in c.alarms] == below
        assert c.stopped_by is None
        assert (s.finish_reason, s.stopped_by) == ("stop", "alarm")
        assert [a.index for a in s.alarms] == below[:1]
        assert s.segments == c.segments[: below[0] + 1]
        assert s.token_ids == c.token_ids[: len(s.token_ids)]


def test_alarms_compare_the_calibrated_probability(demo: tuple[Any, Any]) -> None:
    """With a calibration the figure compared is `confidence.calibrated` (here half the
    probability), the one the record reports, not the raw probability."""
    from tokentrail.calibrate.apply import Calibration
    from tokentrail.calibrate.fingerprint import model_fingerprint

    model, tok = demo
    cal = Calibration.from_dict({
        "format": "tokentrail-calibration", "ranking": ["geo_prob"],
        "segment_measure": "geo_prob", "fingerprint": model_fingerprint(model, tok),
        "maps": {"geo_prob": {"kind": "isotonic", "x": [0.0, 1.0], "y": [0.0, 0.5]}},
    })  # fmt: skip
    rs = list(stream_generate(model, tok, PROMPT, max_tokens=40, calibration=cal,
                              alarm={"below": P}))  # fmt: skip
    units = [r.confidence for r in rs if r.text or r.last_segment_tokens]
    assert all(c.calibrated is not None for c in units)
    got = [a.index for r in rs for a in r.alarms]
    assert got == [i for i, c in enumerate(units) if c.calibrated < P]
    assert got != [i for i, c in enumerate(units) if c.probability < P]
    assert all(a.value == units[a.index].calibrated for r in rs for a in r.alarms)
