"""`stream_generate(..., reasoning=..., fields=True)` on real model output.

Reasoning: the demo model's greedy output (MLX and torch) is split at markers taken from
that output, cut across tokens; the oracle is `str.find` on the whole decoded text and
each token's bytes come from `tokenizers`' own decode. Fields: MLX is forced (a logits
processor) to write a JSON reply; the oracle is `json.JSONDecoder.raw_decode` at each
field's offset, and a walk of `json.loads`. Alternatives: the probability of each
boolean value is checked against direct model calls, one per prefix.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest

from tests.helpers.env import require

PROMPT = "The capital of France is"
JSON_REPLY = '{"ok": true, "city": "Oslo", "n": [1, 2.5], "none": null}'


@pytest.fixture(scope="module")
def demo_tokenizer():
    tokenizers = require("tokenizers")
    from tokentrail.generate import DEMO_MODEL

    return tokenizers.Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))


@pytest.fixture(scope="module", params=["mlx", "torch"])
def loaded(request):
    require("mlx_lm" if request.param == "mlx" else "torch", "the demo model's runtime")
    if request.param == "torch":
        require("transformers")
    import tokentrail

    return tokentrail.load(engine=request.param)


def token_bytes(tok, token_id: int) -> bytes:
    text = tok.decode([token_id], skip_special_tokens=False)
    assert text.isascii(), "the oracle decodes whole ASCII tokens only"
    return text.encode()


def channel_bytes(tok, spans) -> bytes:
    return b"".join(token_bytes(tok, t.id)[t.start : t.end] for t in spans)


def markers(full: str, boundaries: list[int]) -> tuple[str, str]:
    """START cut across two tokens near the start, END across two later ones: the first
    such pieces of text that occur nowhere earlier."""
    first = [b for b in boundaries[3:] if full.find(full[b - 3 : b + 2]) == b - 3]
    b1 = first[0]
    start = full[b1 - 3 : b1 + 2]
    later = [
        b for b in boundaries[len(boundaries) // 2 :]
        if b + 2 <= len(full) and full.find(full[b - 1 : b + 2], b1 + 2) == b - 1
    ]
    end = full[later[0] - 1 : later[0] + 2]
    return start, end


def test_reasoning_channels_on_real_output(loaded, demo_tokenizer) -> None:
    from tokentrail import stream_generate

    model, tokenizer = loaded
    plain = list(stream_generate(model, tokenizer, PROMPT, max_tokens=40))
    full = "".join(r.text for r in plain)
    boundaries = []
    pos = 0
    for r in plain:
        pos += len(r.text)
        boundaries.append(pos)
    start, end = markers(full, boundaries)
    rs = list(stream_generate(model, tokenizer, PROMPT, max_tokens=40, reasoning=(start, end)))
    assert [r.token for r in rs] == [r.token for r in plain]
    assert "".join(r.text for r in rs) == full  # `text` keeps its meaning
    i = full.find(start)
    j = full.find(end, i + len(start))
    want = {"content": full[:i] + full[j + len(end) :], "reasoning": full[i + len(start) : j]}
    parts = [p for r in rs for p in r.channels]
    last = rs[-1]
    for channel in ("reasoning", "content"):
        mine = [p for p in parts if p.channel == channel]
        text = "".join(p.text for p in mine)
        assert text == want[channel]
        assert channel_bytes(demo_tokenizer, [t for p in mine for t in p.tokens]) == text.encode()
    assert last.reasoning == want["reasoning"] and last.content == want["content"]
    assert "".join(r.reasoning_text for r in rs) == want["reasoning"]
    assert "".join(r.content_text for r in rs) == want["content"]
    assert "".join(p.text for p in parts if p.channel == "markup") == start + end
    # Every generated token, in order, its bytes covered once across the channels.
    covered: dict[int, list[tuple[int, int]]] = {}
    order = []
    for p in parts:
        for t in p.tokens:
            covered.setdefault(t.index, []).append((t.start, t.end))
            order.append(t.index)
    assert order == sorted(order)
    assert sorted(covered) == list(range(len(rs)))
    for index, ranges in covered.items():
        ranges.sort()
        size = len(token_bytes(demo_tokenizer, rs[index].token))
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    straddling = [k for k, v in covered.items() if len(v) > 1]
    assert straddling, "the markers should cut a token"
    assert set(last.channel_confidence) == {"reasoning", "content", "markup"}
    assert last.channel_confidence["reasoning"].n_tokens == len(
        {t.index for p in parts if p.channel == "reasoning" for t in p.tokens}
    )
    d = last.to_dict()
    assert d["channel"] == last.channel and d["reasoning"] == want["reasoning"]
    json.dumps(d)


def test_empty_start_marker_reasons_from_the_reply(loaded) -> None:
    from tokentrail import stream_generate

    model, tokenizer = loaded
    rs = list(stream_generate(model, tokenizer, PROMPT, max_tokens=20))
    full = "".join(r.text for r in rs)
    end = full[8:11]
    j = full.find(end)
    out = list(stream_generate(model, tokenizer, PROMPT, max_tokens=20, reasoning=("", end)))
    assert out[0].channel == "reasoning" or j == 0
    assert out[-1].reasoning == full[:j]
    assert out[-1].content == full[j + len(end) :]


def test_bad_reasoning_arguments(loaded) -> None:
    from tokentrail import stream_generate

    model, tokenizer = loaded
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        stream_generate(model, tokenizer, PROMPT, reasoning="nope")
    with pytest.raises(ValueError, match="whole_tokens"):
        stream_generate(model, tokenizer, PROMPT, fields=True, whole_tokens=True)


def leaves(value, path=""):
    """(JSON Pointer, value) of every leaf, by walking `json.loads`' result."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, f"{path}/{k.replace('~', '~0').replace('/', '~1')}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, f"{path}/{i}")
    else:
        yield path, value


@pytest.fixture(scope="module")
def forced_json():
    """The demo model on MLX made to write JSON_REPLY then EOS (prompt ids, responses)."""
    require("mlx_lm", "the demo model's runtime")
    import mlx.core as mx

    import tokentrail
    from tokentrail import stream_generate

    model, tokenizer = tokentrail.load()
    forced = [*tokenizer.encode(JSON_REPLY, add_special_tokens=False), tokenizer.eos_token_id]
    step = {"i": 0}

    def force(tokens, logits):
        want = forced[min(step["i"], len(forced) - 1)]  # mlx-lm runs a step ahead
        step["i"] += 1
        keep = mx.arange(logits.shape[-1]) == want
        return mx.where(keep, logits, mx.array(-math.inf, logits.dtype))

    prompt = "Answer in JSON:"
    rs = list(stream_generate(
        model, tokenizer, prompt, max_tokens=len(forced) + 1, logits_processors=[force],
        fields=True,
    ))
    return model, tokenizer, tokenizer.encode(prompt), rs


def test_fields_of_forced_json(forced_json, demo_tokenizer) -> None:
    _model, _tok, _ids, rs = forced_json
    full = "".join(r.text for r in rs)
    assert full == JSON_REPLY and rs[-1].finish_reason == "stop"
    last = rs[-1]
    assert last.fields_error is None
    streamed = [f for r in rs for f in r.fields]
    assert [f.path for f in streamed] == [f.path for f in last.all_fields]
    assert [(f.path, f.value) for f in streamed] == list(leaves(json.loads(full)))
    decoder = json.JSONDecoder()
    seen = 0
    for r in rs:
        seen += len(r.text)
        for f in r.fields:
            value, end = decoder.raw_decode(full, f.start)
            assert (value, end) == (f.value, f.end) and full[f.start : f.end] == f.text
            assert f.end <= seen  # given once its last character has arrived
            assert channel_bytes(demo_tokenizer, f.tokens) == f.text.encode()
            assert f.confidence is not None
    json.dumps(last.to_dict())


def test_boolean_alternatives_match_the_model(forced_json, demo_tokenizer) -> None:
    import mlx.core as mx

    model, tokenizer, prompt_ids, rs = forced_json
    out = [r.token for r in rs]
    (ok,) = [f for f in rs[-1].all_fields if f.path == "/ok"]
    assert ok.reason is None and [a.value for a in ok.alternatives] == [True, False]
    first, last_tok = ok.tokens[0], ok.tokens[-1]
    lead = demo_tokenizer.decode([first.id])[: first.start]
    tail = demo_tokenizer.decode([last_tok.id])[last_tok.end :]
    for alt, word in zip(ok.alternatives, ("true", "false"), strict=True):
        ids = tokenizer.encode(lead + word + tail, add_special_tokens=False)
        head = list(prompt_ids) + out[: first.index]
        total = 0.0
        for j, t in enumerate(ids):
            logits = model(mx.array(head + ids[:j])[None])[0, -1].astype(mx.float32)
            total += (logits[t] - mx.logsumexp(logits)).item()
        assert alt.probability == pytest.approx(math.exp(total), rel=2e-3)
    assert sum(a.normalized for a in ok.alternatives) == pytest.approx(1.0)
    # Leaves without allowed values get none, and no reason.
    (city,) = [f for f in rs[-1].all_fields if f.path == "/city"]
    assert city.alternatives is None and city.reason is None


def test_torch_scorer_matches_the_model() -> None:
    require("torch", "the torch engine")
    require("transformers")
    import torch

    import tokentrail
    from tokentrail.engines import engine_for
    from tokentrail.engines.scoring import scorer_for

    model, tokenizer = tokentrail.load(engine="torch")
    prompt = tokenizer.encode(PROMPT)
    out = [r.token for r in tokentrail.stream_generate(model, tokenizer, PROMPT, max_tokens=8)]
    scorer, why = scorer_for(engine_for(model), tokenizer, prompt, out)
    assert why is None
    got = scorer.continuation_logprobs(3, out[3:6])
    for j, lp in enumerate(got):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + out[: 3 + j]])).logits[0, -1].float()
        assert lp == pytest.approx(torch.log_softmax(logits, -1)[out[3 + j]].item(), abs=1e-4)
