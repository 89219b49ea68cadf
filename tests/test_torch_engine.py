"""The PyTorch engine: same tokens as MLX, exact logprobs, mlx-lm's sampling semantics.

Runs on the built-in demo model when it is installed, else on a tiny random-weight
Llama saved by transformers in a temporary folder, with GPT-2's real tokenizer.json
from the corpus. Logprobs are checked against an independent full forward pass (no
KV cache); processors and filters against mlx-lm's own implementations.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import require
from tests.helpers.models import build_tiny_llama, gpt2_tokenizer_json

torch = require("torch")
require("transformers")

from tokentrail import stream_generate  # noqa: E402
from tokentrail.engines import ENGINES, Engine  # noqa: E402
from tokentrail.engines import torch_engine as te  # noqa: E402
from tokentrail.engines.torch_engine import TorchEngine  # noqa: E402
from tokentrail.generate import DEMO_MODEL, GenerationResponse  # noqa: E402
from tokentrail.prompting import vocab_for  # noqa: E402
from tokentrail.sampling import SamplingParams, make_params  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GPT2_EOS = 50256
#: A second end token in the tiny model's generation config (as chat models have).
EXTRA_EOS = 50255
PROMPTS = ["The quick brown fox", "def main():\n    ", "Zürich ist schön, 東京も"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if (DEMO_MODEL / "config.json").is_file() and (DEMO_MODEL / "model.safetensors").is_file():
        return DEMO_MODEL
    tok = gpt2_tokenizer_json()
    return build_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama-torch"), tok, framework="torch", hidden_size=64,
        intermediate_size=128, context=256, extra_eos=EXTRA_EOS,
    )


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # The CI machine has two shared cores; torch's spinning thread pool slows a tiny
    # model down many times over when another process holds a core.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> tuple[Any, Any]:
    return te.load(model_dir, device="cpu")


@pytest.fixture(scope="module")
def engine(loaded: tuple[Any, Any]) -> TorchEngine:
    return TorchEngine(loaded[0])


def ids_of(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def run(engine: Any, ids: Sequence[int], n: int, **kw: Any) -> list[Any]:
    return list(engine.generate(ids, make_params(**kw), n))


def reference_logprobs(model: Any, ids: Sequence[int]) -> Any:
    """log_softmax of the logits of one full forward pass, no cache, float32."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(ids)]), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def no_near_ties(row: Any, k: int, gap: float = 1e-3) -> bool:
    values = torch.topk(row, k + 1).values
    return bool((values[:-1] - values[1:]).min() > gap)


# -- the engine --------------------------------------------------------------------


def test_greedy_gives_the_same_tokens_as_mlx(loaded: tuple[Any, Any], model_dir: Path) -> None:
    require("mlx.core")
    require("mlx_lm")
    from tokentrail import load
    from tokentrail.engines import engine_for

    model, tok = loaded
    mlx_engine = engine_for(load(model_dir)[0])
    torch_engine = TorchEngine(model)
    for prompt in PROMPTS:
        ids = ids_of(tok, prompt)
        ours = run(torch_engine, ids, 48, top_logprobs=3)
        theirs = run(mlx_engine, ids, 48, top_logprobs=3)
        assert [s.token for s in ours] == [s.token for s in theirs], prompt
        for a, b in zip(ours, theirs, strict=True):
            # Two frameworks, two float32 summation orders: close, not bit-identical.
            assert a.logprob == pytest.approx(b.logprob, abs=2e-3)
            assert [lp for _, lp in a.top_logprobs] == pytest.approx(
                [lp for _, lp in b.top_logprobs], abs=2e-3
            )


def test_logprobs_match_a_full_forward_pass(engine: TorchEngine, loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    ids = ids_of(tok, PROMPTS[0])
    steps = run(engine, ids, 24, temp=1.0, seed=3, top_logprobs=5)
    ref = reference_logprobs(model, ids + [s.token for s in steps])
    assert steps[0].logprobs.shape == (engine.vocab_size,)
    for i, s in enumerate(steps):
        row = ref[len(ids) - 1 + i]
        assert s.logprob == pytest.approx(row[s.token].item(), abs=1e-4)
        assert torch.allclose(s.logprobs, row, atol=1e-4)
        top_ids = [t for t, _ in s.top_logprobs]
        top_lps = [lp for _, lp in s.top_logprobs]
        assert top_lps == sorted(top_lps, reverse=True)
        assert len(set(top_ids)) == 5
        want = torch.topk(row, 5)
        assert top_lps == pytest.approx(want.values.tolist(), abs=1e-4)
        for t, lp in s.top_logprobs:
            assert lp == pytest.approx(row[t].item(), abs=1e-4)
        if no_near_ties(row, 5):
            assert top_ids == want.indices.tolist()


def test_greedy_picks_the_top_alternative(engine: TorchEngine, loaded: tuple[Any, Any]) -> None:
    _, tok = loaded
    for s in run(engine, ids_of(tok, PROMPTS[1]), 12, top_logprobs=2):
        assert s.token == s.top_logprobs[0][0]
        assert s.logprob == s.top_logprobs[0][1]
        assert s.token == int(torch.argmax(s.logprobs))


def test_chunked_prefill_gives_the_same_stream(
    engine: TorchEngine, loaded: tuple[Any, Any]
) -> None:
    model, tok = loaded
    ids = ids_of(tok, " ".join(PROMPTS) * 2)
    assert len(ids) > 8
    whole = run(engine, ids, 10, top_logprobs=2)
    chunked = run(TorchEngine(model, prefill_step_size=3), ids, 10, top_logprobs=2)
    assert [s.token for s in chunked] == [s.token for s in whole]
    for a, b in zip(chunked, whole, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_a_one_token_prompt_works(engine: TorchEngine, loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    first = ids_of(tok, "Hello")[:1]
    steps = run(engine, first, 4)
    ref = reference_logprobs(model, first + [s.token for s in steps])
    for i, s in enumerate(steps):
        assert s.logprob == pytest.approx(ref[i, s.token].item(), abs=1e-4)


def test_seed_makes_sampling_reproducible(engine: TorchEngine, loaded: tuple[Any, Any]) -> None:
    _, tok = loaded
    ids = ids_of(tok, PROMPTS[0])
    kw: dict[str, Any] = {"temp": 1.5, "top_p": 0.98}
    a = [s.token for s in run(engine, ids, 16, seed=11, **kw)]
    b = [s.token for s in run(engine, ids, 16, seed=11, **kw)]
    c = [s.token for s in run(engine, ids, 16, seed=12, **kw)]
    assert a == b
    assert a != c


def test_sampling_follows_the_distribution(engine: TorchEngine, loaded: tuple[Any, Any]) -> None:
    _, tok = loaded
    ids = ids_of(tok, PROMPTS[2])
    draws = 300
    tokens = []
    probs = None
    for seed in range(draws):
        (s,) = run(engine, ids, 1, temp=0.7, seed=seed)
        tokens.append(s.token)
        probs = torch.softmax(s.logprobs / 0.7, dim=-1)  # the distribution drawn from
    assert probs is not None
    # Every draw is a token the model gives real probability to.
    assert min(probs[t].item() for t in tokens) > 0
    # The most likely token comes up about as often as its probability says.
    top = int(torch.argmax(probs))
    p = probs[top].item()
    freq = tokens.count(top) / draws
    assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / draws) + 0.01


def test_filters_keep_the_same_tokens_as_mlx_lm(
    engine: TorchEngine, loaded: tuple[Any, Any]
) -> None:
    mx = require("mlx.core")
    sample_utils = require("mlx_lm.sample_utils")
    _, tok = loaded
    ids = ids_of(tok, PROMPTS[0])
    (s,) = run(engine, ids, 1)
    row = s.logprobs
    mlx_row = mx.array(row.numpy())[None]
    cases: list[tuple[dict[str, Any], Any, Any]] = [
        *(
            ({"top_p": p}, te.apply_top_p(row, p), sample_utils.apply_top_p(mlx_row, p))
            for p in (0.3, 0.9, 0.99)
        ),
        *(
            ({"min_p": p}, te.apply_min_p(row, p), sample_utils.apply_min_p(mlx_row, p))
            for p in (0.05, 0.5)
        ),
        *(
            ({"top_k": k}, te.apply_top_k(row, k), sample_utils.apply_top_k(mlx_row, k))
            for k in (1, 7)
        ),
    ]
    probs = row.double().exp()
    for kw, ours, theirs in cases:
        kept = torch.isfinite(ours)
        mlx_kept = torch.tensor([not v for v in mx.isinf(theirs)[0].tolist()])
        differ = (kept != mlx_kept).nonzero().flatten().tolist()
        if "top_p" in kw:
            # Both sum the whole vocabulary in float32; MLX's cumsum drifts by ~1e-4 over
            # 50k entries, which can move the cut across tail tokens right at the cut.
            for i in differ:
                above = probs[probs > probs[i]].sum().item()
                assert above == pytest.approx(kw["top_p"] * probs.sum().item(), abs=5e-4), kw
            assert len(differ) <= 0.02 * int(kept.sum())
        else:
            assert differ == [], kw
        assert torch.equal(ours[kept], row[kept])  # kept tokens keep their logprobs
        # The engine only ever samples tokens the filter keeps.
        for seed in range(12):
            (step,) = run(engine, ids, 1, temp=1.5, seed=seed, **kw)
            assert kept[step.token], kw


def test_filters_narrowed_to_one_token_are_greedy(
    engine: TorchEngine, loaded: tuple[Any, Any]
) -> None:
    _, tok = loaded
    ids = ids_of(tok, PROMPTS[1])
    greedy = [s.token for s in run(engine, ids, 10)]
    for kw in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}):
        sampled = [s.token for s in run(engine, ids, 10, temp=2.0, seed=5, **kw)]
        assert sampled == greedy, kw


def test_logit_bias_and_repetition_penalty_match_mlx_lm(
    engine: TorchEngine, loaded: tuple[Any, Any]
) -> None:
    mx = require("mlx.core")
    sample_utils = require("mlx_lm.sample_utils")
    np = require("numpy")
    model, tok = loaded
    # Longer than the penalty's 20-token window: the first words fall outside it.
    ids = ids_of(tok, "Zebra quantum marmalade. " + " ".join(map(str, range(1, 13))) + " 7 8 9")
    assert len(ids) > 24
    bias = {ids[1]: 2.5, ids[-1]: -3.0, 17: 1.0}
    steps = run(engine, ids, 8, logit_bias=bias, repetition_penalty=1.7, top_logprobs=3)
    generated = [s.token for s in steps]
    with torch.inference_mode():
        raw = model(input_ids=torch.tensor([ids + generated]), use_cache=False).logits[0].float()
    processors = sample_utils.make_logits_processors(bias, 1.7)
    for i, s in enumerate(steps):
        history = mx.array(ids + generated[:i])
        logits = mx.array(raw[len(ids) - 1 + i].numpy())[None]
        for processor in processors:
            logits = processor(history, logits)
        want = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        want_row = torch.from_numpy(np.array(want[0]))
        assert s.token == int(torch.argmax(want_row))
        assert s.logprob == pytest.approx(want_row[s.token].item(), abs=1e-4)
        assert torch.allclose(s.logprobs, want_row, atol=1e-4)


def test_creating_the_generator_does_no_model_work_and_closing_stops_it(
    engine: TorchEngine, loaded: tuple[Any, Any]
) -> None:
    model, tok = loaded
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        ids = ids_of(tok, PROMPTS[0])
        gen = engine.generate(ids, make_params(temp=1.0, seed=0), 50)
        assert calls == []  # nothing runs before the first next()
        for i, _ in enumerate(gen):
            if i == 2:
                break
        prefill = 1 if len(ids) > 1 else 0
        assert len(calls) == prefill + 3  # on the CPU no step runs ahead of the reader
        gen.close()
        with pytest.raises(StopIteration):
            next(gen)
        assert len(calls) == prefill + 3
    finally:
        handle.remove()


def test_max_tokens_bounds_the_stream(engine: TorchEngine, loaded: tuple[Any, Any]) -> None:
    _, tok = loaded
    assert len(run(engine, ids_of(tok, "Hi"), 5)) == 5
    gen = engine.generate(ids_of(tok, "Hi"), make_params(), None)
    assert len([s for _, s in zip(range(7), gen, strict=False)]) == 7
    gen.close()


@pytest.mark.parametrize(
    ("ids", "params", "limit", "error", "message"),
    [
        ([], SamplingParams(), 4, ValueError, "empty"),
        ([1, -1], SamplingParams(), 4, ValueError, "token id -1"),
        ([1, 10**9], SamplingParams(), 4, ValueError, "outside the vocabulary"),
        ([1, "2"], SamplingParams(), 4, TypeError, "ints"),
        ([1, 2], SamplingParams(), 0, ValueError, "max_tokens"),
        ([1, 2], {"temp": 0.5}, 4, TypeError, "SamplingParams"),
    ],
)
def test_bad_engine_input_raises_at_the_call(
    engine: TorchEngine, ids: list[Any], params: Any, limit: int, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        engine.generate(ids, params, limit)


def test_protocol_and_metadata(
    engine: TorchEngine, loaded: tuple[Any, Any], model_dir: Path
) -> None:
    model, _ = loaded
    config = json.loads((model_dir / "config.json").read_text())
    assert isinstance(engine, Engine)
    assert engine.name == "torch"
    assert engine.vocab_size == config["vocab_size"]
    assert engine.context_length == config["max_position_embeddings"]
    assert engine.peak_memory() == 0.0  # CPU: torch keeps no allocator statistics
    assert te.accepts(model)
    assert not te.accepts(object())
    assert not te.accepts(torch.nn.Linear(2, 2))
    assert isinstance(te.wrap(model), TorchEngine)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not model.training


# -- loading -------------------------------------------------------------------------


def test_tokenizer_knows_every_end_token(loaded: tuple[Any, Any], model_dir: Path) -> None:
    _, tok = loaded
    gen_config = json.loads((model_dir / "generation_config.json").read_text())
    want = gen_config["eos_token_id"]
    want = set(want if isinstance(want, list) else [want]) | {tok.eos_token_id}
    assert len(want) > 1  # the fixture models end turns with a second token
    assert tok.eos_token_ids == want
    assert type(tok).__module__.startswith("transformers")


def test_load_errors_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        te.load(tmp_path / "no-such-model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        te.load(empty)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "not_a_real_arch"}))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="not_a_real_arch"):
        te.load(bad)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="weights"):
        te.load(no_weights)
    with pytest.raises(ValueError, match="folder"):
        te.load(bad / "config.json")


# -- stream_generate on the torch engine -------------------------------------------------


def collect(model: Any, tok: Any, prompt: Any, **kw: Any) -> list[GenerationResponse]:
    return list(stream_generate(model, tok, prompt, **kw))


def check_attribution(tok: Any, responses: list[GenerationResponse]) -> None:
    """Text equals the tokenizer's decode; every token is attributed, in order."""
    ids = [r.token for r in responses]
    body = ids[:-1] if ids[-1] in tok.eos_token_ids else ids
    assert "".join(r.text for r in responses) == tok.decode(body, skip_special_tokens=True)
    spans = [t for r in responses for t in r.last_segment_tokens]
    assert sorted({t.index for t in spans}) == list(range(len(ids)))
    assert all(ids[t.index] == t.id for t in spans)
    assert [t.index for t in spans] == sorted(t.index for t in spans)
    assert [r.finish_reason is not None for r in responses] == [False] * (len(ids) - 1) + [True]


def test_stream_generate_end_to_end(engine: TorchEngine, loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    for prompt in PROMPTS:
        out = collect(engine, tok, prompt, max_tokens=40, temp=0.9, seed=2, top_logprobs=3)
        check_attribution(tok, out)
        ids = tok.encode(prompt)
        ref = reference_logprobs(model, list(ids) + [r.token for r in out])
        vocab = vocab_for(tok)
        for i, r in enumerate(out):
            assert r.token_logprob == pytest.approx(ref[len(ids) - 1 + i, r.token].item(), abs=1e-4)
            assert [a.logprob for a in r.top_logprobs] == sorted(
                (a.logprob for a in r.top_logprobs), reverse=True
            )
            for a in r.top_logprobs:
                assert a.bytes == vocab.token_bytes(a.id)
            for span in r.last_segment_tokens:
                assert span.logprob == pytest.approx(out[span.index].token_logprob)
        json.dumps([r.to_dict() for r in out])


def test_stream_generate_greedy_equals_the_engine(
    engine: TorchEngine, loaded: tuple[Any, Any]
) -> None:
    _, tok = loaded
    eos = set(tok.eos_token_ids)
    ids = tok.encode(PROMPTS[0])
    steps = [s.token for s in run(engine, ids, 40)]
    out = collect(engine, tok, list(ids), max_tokens=40)
    cut = next((i + 1 for i, t in enumerate(steps) if t in eos), len(steps))
    assert [r.token for r in out] == steps[:cut]
    check_attribution(tok, out)


def test_every_end_token_stops_generation(engine: TorchEngine, loaded: tuple[Any, Any]) -> None:
    _, tok = loaded
    for eos in sorted(tok.eos_token_ids):
        out = collect(engine, tok, "Hi", max_tokens=5, logit_bias={eos: 1e4})
        assert [(r.token, r.text, r.finish_reason) for r in out] == [(eos, "", "stop")]
        assert [(t.index, t.id) for t in out[0].last_segment_tokens] == [(0, eos)]


def test_chat_messages_use_the_chat_template(engine: TorchEngine, loaded: tuple[Any, Any]) -> None:
    _, tok = loaded
    messages = [{"role": "user", "content": "What is a list?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    out = collect(engine, tok, messages, max_tokens=8)
    assert out[0].prompt_tokens == len(ids)
    assert [r.token for r in out] == [r.token for r in collect(engine, tok, ids, max_tokens=8)]
    check_attribution(tok, out)


def test_breaking_out_of_stream_generate_stops_the_model(
    engine: TorchEngine, loaded: tuple[Any, Any]
) -> None:
    model, tok = loaded
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        it = stream_generate(engine, tok, PROMPTS[0], max_tokens=50, temp=1.0, seed=1)
        for i, _ in enumerate(it):
            if i == 2:
                break
        it.close()
        assert len(calls) == 1 + 3  # one prefill pass, three steps, nothing after
    finally:
        handle.remove()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temp": -0.5}, "temp"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {10**9: 1.0}}, "logit_bias"),
        ({"prompt": [1, 10**9]}, "prompt"),
        ({"prompt": ""}, "prompt"),
    ],
)
def test_stream_generate_bad_input(
    engine: TorchEngine, loaded: tuple[Any, Any], kwargs: dict[str, Any], message: str
) -> None:
    _, tok = loaded
    kw = {"prompt": "Hello", **kwargs}
    prompt = kw.pop("prompt")
    with pytest.raises((ValueError, TypeError), match=message):
        stream_generate(engine, tok, prompt, **kw)


def test_prompt_longer_than_the_context_raises(
    engine: TorchEngine, loaded: tuple[Any, Any]
) -> None:
    _, tok = loaded
    ctx = engine.context_length
    assert ctx is not None
    with pytest.raises(ValueError, match="context"):
        stream_generate(engine, tok, [1] * ctx, max_tokens=1)
    out = collect(engine, tok, [1] * (ctx - 1), max_tokens=10)
    assert len(out) == 1 and out[0].finish_reason in ("length", "stop")


@pytest.mark.skipif("torch" not in ENGINES, reason="engine='torch' is not registered yet")
def test_load_with_engine_torch_dispatches(model_dir: Path) -> None:
    from tokentrail import load
    from tokentrail.engines import engine_for

    model, tok = load(model_dir, engine="torch")
    assert isinstance(engine_for(model), TorchEngine)
    out = collect(model, tok, PROMPTS[0], max_tokens=12, top_logprobs=2)
    check_attribution(tok, out)


def test_the_http_server_serves_a_torch_model(engine: TorchEngine, loaded: tuple[Any, Any]) -> None:
    require("starlette")
    from starlette.testclient import TestClient

    from tokentrail.server import create_app

    _, tok = loaded
    app = create_app(model=engine, tokenizer=tok, model_name="torch-model")
    body = {"model": "torch-model", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
            "logprobs": 2}  # fmt: skip
    with TestClient(app) as client:
        reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    want = collect(engine, tok, PROMPTS[0], max_tokens=8, top_logprobs=2)
    assert choice["text"] == "".join(r.text for r in want)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        [r.token_logprob for r in want], abs=1e-6
    )
