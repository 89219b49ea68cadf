"""Field retry (issue #31): a JSON leaf below a confidence threshold is sampled again
from its first token, and the most confident attempt is kept.

Real parts: the demo model on MLX, real llguidance. Oracles: `jsonschema` validates
the whole reply; the model itself, run once over the prompt and the final reply, gives
each kept token's logprob (the KV cache after the rollbacks must be exactly the kept
attempt's); a run without retry gives the reply up to the retried field's start.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.env import require

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "city": {"type": "string", "maxLength": 10},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["ok", "city", "n"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.fixture(scope="module")
def mlx_demo():
    require("mlx_lm", "the demo model's runtime")
    import tokentrail

    return tokentrail.load()


def _run(mlx_demo, **kw):
    from tokentrail import stream_generate

    model, tok = mlx_demo
    return list(stream_generate(model, tok, MESSAGES, max_tokens=60, json_schema=SCHEMA, **kw))


def _score(field) -> float:
    conf = field.confidence
    return conf.calibrated if conf.calibrated is not None else conf.probability


def _forward_logprobs(mlx_demo, ids: list[int], n_reply: int) -> list[float]:
    """The model's own logprob of each of the last `n_reply` ids, in one forward pass."""
    import mlx.core as mx

    model, _ = mlx_demo
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    start = len(ids) - n_reply
    return [logprobs[i - 1, ids[i]].item() for i in range(start, len(ids))]


@pytest.fixture(scope="module")
def base(mlx_demo):
    return _run(mlx_demo, top_logprobs=3)


@pytest.fixture(scope="module")
def below(base):
    """A threshold the first field clears and a later one does not (the demo model's
    greedy reply, so the same every run)."""
    fields = base[-1].all_fields
    first, later = _score(fields[0]), min(_score(f) for f in fields[1:])
    assert first > later, "the demo model's reply no longer has a low field after a high one"
    return math.sqrt(first * later)


@pytest.fixture(scope="module")
def retried(mlx_demo, below):
    retry = {"below": below, "max": 3, "temperature": 1.0}
    return _run(mlx_demo, retry=retry, seed=7, top_logprobs=3)


def test_reply_is_valid_and_emitted_once(retried):
    jsonschema = require("jsonschema")
    final = retried[-1]
    text = "".join(r.text for r in retried)
    assert final.finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    # each token once, in order: the retried attempts' tokens were never emitted
    indexes = [r.generation_tokens - 1 for r in retried]
    assert indexes == list(range(len(retried)))
    spans = [t for r in retried for t in r.last_segment_tokens]
    assert [t.index for t in spans] == sorted({t.index for t in spans})
    assert [f.value for f in final.all_fields] == list(json.loads(text).values())


def test_attempts_listed_and_most_confident_kept(retried, below):
    fields = retried[-1].all_fields
    tried = [f for f in fields if f.attempts is not None]
    assert tried, "no field was retried"
    for f in tried:
        kept = [a for a in f.attempts if a.kept]
        assert len(kept) == 1
        assert kept[0].value == f.value and kept[0].text == f.text
        best = max(a.confidence.probability for a in f.attempts)
        assert kept[0].confidence.probability == best == _score(f)
        assert len(f.attempts) >= 2
        # retried because the first attempt was below; stopped at the first one above
        assert f.attempts[0].confidence.probability < below
        assert all(a.confidence.probability < below for a in f.attempts[:-1])
        d = f.to_dict()
        assert [a["value"] for a in d["attempts"]] == [a.value for a in f.attempts]
    for f in fields:
        if f.attempts is None:
            assert _score(f) >= below or f is not fields[0]


def test_kept_logprobs_equal_a_fresh_forward_pass(mlx_demo, retried):
    from tokentrail.prompting import prompt_ids

    _, tok = mlx_demo
    ids = prompt_ids(tok, MESSAGES, None)
    reply = [r.token for r in retried]
    truth = _forward_logprobs(mlx_demo, ids + reply, len(reply))
    got = [r.token_logprob for r in retried]
    assert got == pytest.approx(truth, abs=2e-4)
    # the fields' tokens carry the same logprobs
    for f in retried[-1].all_fields:
        for t in f.tokens:
            assert t.logprob == pytest.approx(truth[t.index], abs=2e-4)


def test_other_fields_untouched(base, retried):
    fields = retried[-1].all_fields
    first_tried = next(f for f in fields if f.attempts is not None)
    start = first_tried.tokens[0].index
    assert [r.token for r in retried[:start]] == [r.token for r in base[:start]]
    assert [r.text for r in retried[:start]] == [r.text for r in base[:start]]
    for mine, theirs in zip(fields, base[-1].all_fields, strict=False):
        if mine is first_tried:
            break
        assert (mine.value, mine.text, mine.tokens) == (theirs.value, theirs.text, theirs.tokens)


def test_no_retry_above_threshold_is_the_plain_run(mlx_demo, base):
    same = _run(mlx_demo, retry={"below": 0.0, "max": 2}, top_logprobs=3)
    assert [r.token for r in same] == [r.token for r in base]
    assert all(f.attempts is None for f in same[-1].all_fields)


def test_retry_needs_a_json_constraint(mlx_demo):
    from tokentrail import stream_generate

    model, tok = mlx_demo
    with pytest.raises(ValueError, match="retry needs a JSON constraint"):
        stream_generate(model, tok, "hi", retry={"below": 0.5})
    with pytest.raises(ValueError, match=r"retry\.below"):
        stream_generate(model, tok, "hi", json_schema=SCHEMA, retry={"below": 1.5})
    with pytest.raises(ValueError, match=r"retry\.max"):
        stream_generate(model, tok, "hi", json_schema=SCHEMA, retry={"below": 0.5, "max": 0})


def test_rewind_then_greedy_repeats_and_force_restores(mlx_demo):
    """The engine's rewind: after taking n tokens back, greedy decoding gives the same
    tokens and logprobs again; after forcing them, the next step is the original's."""
    from tokentrail.constrain import constraint_from
    from tokentrail.engines import engine_for
    from tokentrail.prompting import prompt_ids
    from tokentrail.sampling import make_params

    model, tok = mlx_demo
    engine = engine_for(model)
    constraint = constraint_from(json_schema=SCHEMA).bind(tok)
    params = make_params(temp=0.0, top_logprobs=2, vocab_size=engine.vocab_size,
                         constraint=constraint)  # fmt: skip
    ids = prompt_ids(tok, MESSAGES, None)
    steps = engine.generate_rewindable(ids, params, 30)
    first = [next(steps) for _ in range(12)]
    for n in (1, 4, 11, 12):
        steps.rewind(n)
        assert steps.generated == 12 - n
        again = [next(steps) for _ in range(n)]
        assert [s.token for s in again] == [s.token for s in first[12 - n :]]
        assert [s.logprob for s in again] == pytest.approx([s.logprob for s in first[12 - n :]])
        assert [s.allowed_mass for s in again] == pytest.approx(
            [s.allowed_mass for s in first[12 - n :]]
        )
    nxt = next(steps)
    steps.rewind(6)
    steps.force([s.token for s in first[7:]])
    assert steps.generated == 12
    assert next(steps).token == nxt.token
    steps.close()


@pytest.fixture(scope="module")
def greedy_stream(mlx_demo):
    """(a fresh rewindable greedy stream, the first 14 steps of one) on the demo model."""
    from tokentrail.constrain import constraint_from
    from tokentrail.engines import engine_for
    from tokentrail.prompting import prompt_ids
    from tokentrail.sampling import make_params

    model, tok = mlx_demo
    engine = engine_for(model)
    constraint = constraint_from(json_schema=SCHEMA).bind(tok)
    params = make_params(temp=0.0, vocab_size=engine.vocab_size, constraint=constraint)
    ids = prompt_ids(tok, MESSAGES, None)

    def fresh():
        return engine.generate_rewindable(ids, params, 40)

    ref = fresh()
    return fresh, [next(ref).token for _ in range(14)]


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 14), st.integers(0, 6)), min_size=1, max_size=6))
def test_any_rewinds_and_forces_keep_the_greedy_run(greedy_stream, ops):
    """Whatever tokens are taken back and forced again (the ones the greedy run took),
    the next greedy step is the greedy run's: cache, guide and ids stay in step."""
    fresh, ref = greedy_stream
    steps = fresh()
    for _ in range(4):
        next(steps)
    for back, forward in ops:
        # (never past the reference run's last token: its next one must be known)
        at = min(steps.generated - min(back, steps.generated), len(ref) - 1)
        steps.rewind(steps.generated - at)
        upto = min(at + forward, len(ref) - 1)
        steps.force(ref[at:upto])
        assert steps.generated == upto
        assert next(steps).token == ref[upto]
    steps.close()


def test_guide_rollback_gives_the_same_masks(mlx_demo):
    """llguidance's state after rollback(n) is the one n tokens earlier: the same
    allowed ids come again."""
    import numpy as np

    from tokentrail.constrain import constraint_from

    _, tok = mlx_demo
    guide = constraint_from(json_schema=SCHEMA).bind(tok).guide()
    text_ids = tok.encode('{"ok":true,"city":"Rome","n":3}', add_special_tokens=False)
    masks = []
    for t in text_ids:
        masks.append(guide.allowed(guide.size).copy())
        guide.advance(t)
    for n in (1, 3, len(text_ids)):
        guide.rollback(n)
        assert np.array_equal(guide.allowed(guide.size), masks[len(text_ids) - n])
        for t in text_ids[len(text_ids) - n :]:
            guide.advance(t)
    assert guide.rewindable == len(text_ids)
    with pytest.raises(ValueError, match="cannot roll the grammar back"):
        guide.rollback(len(text_ids) + 1)


# -- over HTTP: a real `tokentrail serve` and the official client --

PROMPT = "A city as JSON: "
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "c", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    openai = require("openai", "the official client reads the server's responses")
    require("mlx_lm", "the demo model's runtime")
    from tests.helpers.servers import start_server

    srv = start_server(None, tmp_path_factory.mktemp("logs") / "retry.log")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300), srv
    srv.stop()


def _complete(client, below, **kw):
    c, srv = client
    return c.completions.create(
        model=srv.model, prompt=PROMPT, max_tokens=60, seed=7, logprobs=3,
        extra_body={"response_format": RESPONSE_FORMAT,
                    "tokentrail": {"retry": {"below": below, "max": 3, "temperature": 1.0}}},
        **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def served_below(mlx_demo):
    """A threshold between the fields' lowest and highest confidence, for PROMPT."""
    from tokentrail import stream_generate

    model, tok = mlx_demo
    plain = list(stream_generate(model, tok, PROMPT, max_tokens=60, json_schema=SCHEMA))
    scores = [_score(f) for f in plain[-1].all_fields]
    assert min(scores) < max(scores)
    return math.sqrt(min(scores) * max(scores))


def test_server_whole_reply_retried(client, mlx_demo, served_below):
    jsonschema = require("jsonschema")
    from tokentrail import stream_generate
    from tokentrail.prompting import prompt_ids

    r = _complete(client, served_below)
    text = r.choices[0].text
    jsonschema.validate(json.loads(text), SCHEMA)
    ext = r.model_extra["tokentrail"]
    fields = ext["fields"]
    tried = [f for f in fields if f.get("attempts")]
    assert tried
    for f in tried:
        kept = [a for a in f["attempts"] if a["kept"]]
        assert len(kept) == 1 and kept[0]["value"] == f["value"]
        assert kept[0]["confidence"]["probability"] == max(
            a["confidence"]["probability"] for a in f["attempts"]
        )
    # the kept tokens' logprobs are the model's own over the final text
    model, tok = mlx_demo
    tokens = sorted({t["index"]: t for s in ext["segments"] for t in s["tokens"]}.items())
    ids = prompt_ids(tok, PROMPT, None)
    reply = [t["id"] for _, t in tokens]
    truth = _forward_logprobs(mlx_demo, ids + reply, len(reply))
    assert [t["logprob"] for _, t in tokens] == pytest.approx(truth, abs=2e-4)
    # the library does the same with the same seed
    retry = {"below": served_below, "max": 3, "temperature": 1.0}
    mine = list(stream_generate(model, tok, PROMPT, max_tokens=60, json_schema=SCHEMA, seed=7,
                                top_logprobs=3, retry=retry))  # fmt: skip
    assert "".join(m.text for m in mine) == text
    assert [f.to_dict()["attempts"] if f.attempts else None for f in mine[-1].all_fields] == [
        f.get("attempts") for f in fields
    ]


def test_server_stream_emits_each_token_once(client, served_below):
    whole = _complete(client, served_below)
    text, seen, indexes = "", [], []
    for chunk in _complete(client, served_below, stream=True):
        ext = chunk.model_extra["tokentrail"]
        if chunk.choices:
            text += chunk.choices[0].text or ""
        indexes += [t["index"] for s in ext.get("segments", []) for t in s["tokens"]]
        seen += ext.get("fields", [])
    assert text == whole.choices[0].text
    assert indexes == sorted(set(indexes))
    assert seen == whole.model_extra["tokentrail"]["fields"]
    assert any(f.get("attempts") for f in seen)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tokentrail": {"retry": {"below": 0.5}}}, "tokentrail.retry"),
        ({"response_format": RESPONSE_FORMAT, "tokentrail": {"retry": {"below": 2}}},
         "tokentrail.retry.below"),
        ({"response_format": RESPONSE_FORMAT, "tokentrail": {"retry": {"below": 0.5, "max": 0}}},
         "tokentrail.retry.max"),
    ],
)  # fmt: skip
def test_server_refuses_retry_it_cannot_do(client, extra, param):
    import openai

    c, srv = client
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=srv.model, prompt=PROMPT, max_tokens=5, extra_body=extra)
    assert info.value.body["param"] == param


def test_torch_retry_matches_a_fresh_forward_pass():
    """torch: the cache is cut with `DynamicCache.crop`; the kept tokens' logprobs are
    the model's own over prompt + final reply in one forward pass."""
    require("transformers")
    torch = require("torch")
    jsonschema = require("jsonschema")
    import tokentrail
    from tokentrail import stream_generate
    from tokentrail.prompting import prompt_ids

    model, tok = tokentrail.load(engine="torch")
    plain = list(stream_generate(model, tok, PROMPT, max_tokens=60, json_schema=SCHEMA))
    scores = [_score(f) for f in plain[-1].all_fields]
    below = math.sqrt(min(scores) * max(scores))
    out = list(stream_generate(model, tok, PROMPT, max_tokens=60, json_schema=SCHEMA, seed=3,
                               retry={"below": below, "max": 3}))  # fmt: skip
    jsonschema.validate(json.loads("".join(r.text for r in out)), SCHEMA)
    tried = [f for f in out[-1].all_fields if f.attempts is not None]
    assert tried
    start = tried[0].tokens[0].index
    assert [r.token for r in out[:start]] == [r.token for r in plain[:start]]
    ids = prompt_ids(tok, PROMPT, None)
    reply = [r.token for r in out]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids + reply])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    truth = [float(logprobs[len(ids) + i - 1, t]) for i, t in enumerate(reply)]
    assert [r.token_logprob for r in out] == pytest.approx(truth, abs=2e-4)


# -- llama.cpp: SmolLM2-135M-Instruct (GGUF) --


def test_llamacpp_retry_keeps_the_most_confident_and_the_model_agrees(smol, smol_ref):
    """On llama.cpp the KV cache is cut with the ids (llama_kv_cache_seq_rm at the next
    decode) and the guide rolls back: the reply is valid, the kept tokens' logprobs are
    llama-cpp-python's own over the final text, and the fields before the first retried
    one are the plain run's."""
    import numpy as np

    jsonschema = require("jsonschema")
    from tokentrail import stream_generate

    engine, tok = smol
    msgs = [{"role": "user", "content": "Describe a city in JSON with ok, city and n."}]
    plain = list(stream_generate(engine, tok, msgs, max_tokens=60, json_schema=SCHEMA))
    scores = [_score(f) for f in plain[-1].all_fields]
    below = math.sqrt(min(scores) * max(scores))
    retried = list(stream_generate(engine, tok, msgs, max_tokens=60, json_schema=SCHEMA, seed=5,
                                   retry={"below": below, "max": 3}))  # fmt: skip
    text = "".join(r.text for r in retried)
    jsonschema.validate(json.loads(text), SCHEMA)
    fields = retried[-1].all_fields
    tried = [f for f in fields if f.attempts is not None]
    assert tried
    for f in tried:
        (kept,) = [a for a in f.attempts if a.kept]
        assert kept.value == f.value
        assert kept.confidence.probability == max(a.confidence.probability for a in f.attempts)
    start = tried[0].tokens[0].index
    assert [r.token for r in retried[:start]] == [r.token for r in plain[:start]]
    # the model's own logprobs over prompt + final reply, from an empty cache, the reply
    # fed a token at a time as generation feeds it (llama.cpp's batch kernels give
    # logits that differ by more than a tolerance from its one-token ones)
    from tokentrail.prompting import prompt_ids

    ids = prompt_ids(tok, msgs, None)
    reply = [r.token for r in retried]
    smol_ref.reset()
    smol_ref.eval(ids)
    for t in reply[:-1]:
        smol_ref.eval([t])
    logits = np.asarray(smol_ref.scores[len(ids) - 1 : len(ids) + len(reply) - 1], dtype=np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    truth = [float(logits[i, t] - lse[i]) for i, t in enumerate(reply)]
    assert [r.token_logprob for r in retried] == pytest.approx(truth, abs=2e-4)


def test_server_retry_beside_the_batch(client, served_below):
    """A retried request (beside the batch) and plain streams (in it) at once: each
    reply is what it is alone, with n = 2 retried choices too."""
    from concurrent.futures import ThreadPoolExecutor

    c, srv = client

    def plain():
        return c.completions.create(model=srv.model, prompt="The capital of France is",
                                    max_tokens=24).choices[0].text  # fmt: skip

    alone_plain = plain()
    alone_retry = _complete(client, served_below)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(plain), pool.submit(_complete, client, served_below),
                   pool.submit(plain)]  # fmt: skip
        got = [f.result() for f in futures]
    assert got[0] == got[2] == alone_plain
    assert got[1].choices[0].text == alone_retry.choices[0].text
    two = _complete(client, served_below, n=2)
    assert [ch.index for ch in two.choices] == [0, 1]
    for ch in two.choices:
        json.loads(ch.text)
