"""Request parsing without a server: every bad body is a 400 naming its field."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.env import require

require("pydantic")

from tokentrail.errors import APIError  # noqa: E402
from tokentrail.sampling import OPENAI_LIMITS, SamplingError, make_params  # noqa: E402
from tokentrail.server.protocol import parse_chat, parse_completion  # noqa: E402

CHAT, COMP = "chat", "completion"
MSG = [{"role": "user", "content": "hi"}]


def _said(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]
CASES = [
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": MSG, "temperature": 2.5}, 400, "temperature"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 1.5}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": True}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "n": 99}, 400, "n"),
    (CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": MSG, "top_k": "5"}, 400, "top_k"),
    (CHAT, {"messages": MSG, "top_k": -5}, 400, "top_k"),
    (CHAT, {"messages": MSG, "min_p": 1.5}, 400, "min_p"),
    (CHAT, {"messages": MSG, "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CHAT, {"messages": MSG, "seed": -1}, 400, "seed"),
    (CHAT, {"messages": MSG, "seed": 2**64}, 400, "seed"),
    (CHAT, {"messages": MSG, "stop": [1, 2]}, 400, "stop"),
    (CHAT, {"messages": MSG, "stop": 5}, 400, "stop"),
    (CHAT, {"messages": MSG, "stop": ""}, 400, "stop"),
    (CHAT, {"messages": MSG, "stop": ["a"]*17}, 400, "stop"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    # json_object is accepted now (tests/test_server_structure.py); a spec without its
    # schema, or one llguidance cannot compile, is still a 400 naming the field
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format"),
    (CHAT, {"messages": MSG, "structured_outputs": {"regex": "("}}, 400, "structured_outputs"),
    (CHAT, {"messages": MSG, "json_schema": {"type": "bogus"}}, 400, "json_schema"),
    (CHAT, {"messages": MSG, "grammar": "root ::= ("}, 400, "grammar"),
    (CHAT, {"messages": MSG, "tokentrail": {"logprobs": "cooked"}}, 400, "tokentrail.logprobs"),
    # the keys that act on confidence (issue #31): param names the key inside tokentrail
    (CHAT, {"messages": MSG, "tokentrail": {"alarm": {"below": 1.5}}}, 400,
     "tokentrail.alarm.below"),
    (CHAT, {"messages": MSG, "tokentrail": {"alarm": {"below": 0.5, "on": "word"}}}, 400,
     "tokentrail.alarm.on"),
    (COMP, {"prompt": "x", "tokentrail": {"alarm": {"below": "low"}}}, 400,
     "tokentrail.alarm.below"),
    (CHAT, {"messages": MSG, "tokentrail": {"alarm": {"on": "field"}}}, 400,
     "tokentrail.alarm.below"),
    (CHAT, {"messages": MSG, "tokentrail": {"retry": {"below": 0.5, "max": 0}}}, 400,
     "tokentrail.retry.max"),
    (CHAT, {"messages": MSG, "tokentrail": {"retry": {"below": 0.5, "temperature": -1}}}, 400,
     "tokentrail.retry.temperature"),
    (CHAT, {"messages": MSG, "tokentrail": {"branch": {"ids": [1, -2], "at": 1}}}, 400,
     "tokentrail.branch.ids"),
    (COMP, {"prompt": "x", "tokentrail": {"branch": {"ids": [1], "at": "0"}}}, 400,
     "tokentrail.branch.at"),
    (CHAT, {"messages": MSG, "tokentrail": {"vote": "loudest"}}, 400, "tokentrail.vote"),
    (CHAT, {"messages": MSG, "tokentrail": {"early_stop": 1}}, 400, "tokentrail.early_stop"),
    (CHAT, {"messages": MSG, "tokentrail": {"volume": 11}}, 400, "tokentrail.volume"),
    (CHAT, {"messages": MSG, "logprobs": "yes"}, 400, "logprobs"),
    (CHAT, {"messages": MSG, "logit_bias": {"-1": 5}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"1": 500}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"1": "x"}}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": [1]}, 400, "logit_bias"),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT, {"messages": MSG, "stream": True, "stream_options": 3}, 400, "stream_options"),
    (CHAT, {"messages": MSG, "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    (CHAT, {"messages": MSG, "presence_penalty": 5}, 400, "presence_penalty"),
    (CHAT, {"messages": MSG, "max_tokens": 3, "max_completion_tokens": 4}, 400,
     "max_completion_tokens"),
    (CHAT, {"messages": MSG, "model": 7}, 400, "model"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    (CHAT, {"messages": _said([{"type": "text", "text": 3}])}, 400, "messages"),
    (CHAT, {"messages": [3]}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (COMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (COMP, {"prompt": "x", "logprobs": True}, 400, "logprobs"),
    (COMP, {"prompt": ["a", "b"]}, 400, "prompt"),
    (COMP, {"prompt": [10**9]}, 400, "prompt"),
    (COMP, {"prompt": 5}, 400, "prompt"),
    (COMP, {"prompt": "x", "echo": "yes"}, 400, "echo"),
    (COMP, {"prompt": "x", "suffix": ""}, 400, "suffix"),
    (COMP, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    (COMP, {}, 400, "prompt"),
    (COMP, {"prompt": ""}, 400, "prompt"),
    (COMP, {"prompt": "a\ud800b"}, 400, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages"),
    (CHAT, {"messages": _said([{"type": "text", "text": "\ud83d"}])}, 400, "messages"),
    (COMP, {"prompt": "x", "stop": ["ok", "\udc00"]}, 400, "stop"),
]


@pytest.mark.parametrize(("kind", "body", "status", "param"), CASES)
def test_bad_bodies_name_the_field(
    kind: str, body: dict[str, Any], status: int, param: str
) -> None:
    parse = parse_chat if kind == CHAT else parse_completion
    with pytest.raises(APIError) as info:
        parse(body, "m", 1000)
    err = info.value
    assert (err.status, err.param) == (status, param)
    assert param in err.message and err.code


def test_good_bodies_become_requests() -> None:
    req = parse_chat(
        {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]},
                      {"role": "assistant", "content": None}],
         "top_k": -1, "seed": 3, "logprobs": True, "top_logprobs": 2, "stop": "x",
         "logit_bias": {"5": 1}, "max_completion_tokens": 5, "user": "ignored"},
        "m", 1000, 0.7,
    )
    assert req.prompt == [{"role": "system", "content": "a"}, {"role": "assistant", "content": ""}]
    assert (req.top_k, req.temperature, req.stop, req.logit_bias) == (0, 0.7, ["x"], {5: 1.0})
    assert (req.max_tokens, req.max_tokens_given, req.top_logprobs) == (5, True, 2)
    one = parse_completion({"prompt": [[1, 2]], "logprobs": 0}, "m", 10)
    assert (one.prompt, one.logprobs, one.top_logprobs, one.max_tokens_given) == (
        [1, 2], True, 0, False)


def test_server_ranges_are_the_sampling_table() -> None:
    """The server's stricter limits are a profile of sampling's table, not a copy."""
    with pytest.raises(SamplingError) as info:
        make_params(temp=2.5, limits=OPENAI_LIMITS)
    assert info.value.param == "temp"
    assert make_params(temp=2.5).temp == 2.5  # the library allows it
    with pytest.raises(SamplingError):
        make_params(logit_bias={1: 101.0}, limits=OPENAI_LIMITS)
