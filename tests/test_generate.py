"""stream_generate on MLX: text, token attribution, logprobs, alternatives, stops, CLI.

Runs on the built-in demo model when it is installed, else on a tiny random-weight
Llama built in a temporary folder with GPT-2's real tokenizer.json from the corpus.
Logprobs are checked against an independent full forward pass without a cache.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import require
from tests.helpers.models import build_tiny_llama, gpt2_tokenizer_json

mx = require("mlx.core")
require("mlx_lm")

import tokentrail  # noqa: E402
from tokentrail import GenerationResponse, confidence_of, load, stream_generate  # noqa: E402
from tokentrail.engines import Step, engine_for  # noqa: E402
from tokentrail.generate import DEMO_MODEL  # noqa: E402
from tokentrail.prompting import vocab_for  # noqa: E402
from tokentrail.sampling import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if (DEMO_MODEL / "config.json").is_file():
        return DEMO_MODEL
    tok = gpt2_tokenizer_json()
    return build_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama"), tok, hidden_size=64, intermediate_size=128,
        context=256, lm_head_scale=4,
    )


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> tuple[Any, Any]:
    return load(model_dir)


def collect(model: Any, tok: Any, prompt: Any, **kw: Any) -> list[GenerationResponse]:
    return list(stream_generate(model, tok, prompt, **kw))


def reference_logprobs(model: Any, ids: Sequence[int]) -> Any:
    """log_softmax of the logits of a full forward pass, no cache, float32."""
    logits = model(mx.array([list(ids)]))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def check_attribution(tok: Any, responses: list[GenerationResponse]) -> None:
    """Text equals the reference decode; every token is attributed, in order."""
    eos = set(tok.eos_token_ids)
    ids = [r.token for r in responses]
    body = ids[:-1] if ids[-1] in eos else ids
    text = "".join(r.text for r in responses)
    assert text == tok.decode(body, skip_special_tokens=True)
    spans = [t for r in responses for t in r.last_segment_tokens]
    assert sorted({t.index for t in spans}) == list(range(len(ids)))
    for t in spans:
        assert ids[t.index] == t.id
    assert [t.index for t in spans] == sorted(t.index for t in spans)
    assert [r.finish_reason is not None for r in responses] == [False] * (len(ids) - 1) + [True]
    assert [r.generation_tokens for r in responses] == list(range(1, len(ids) + 1))


# -- generation ----------------------------------------------------------------------


def test_text_tokens_and_logprobs_match_a_full_forward_pass(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    prompt = "The quick brown fox"
    out = collect(model, tok, prompt, max_tokens=16, temp=1.0, seed=3, top_logprobs=5)
    check_attribution(tok, out)
    prompt_ids = tok.encode(prompt)
    assert out[0].prompt_tokens == len(prompt_ids)
    ref = reference_logprobs(model, prompt_ids + [r.token for r in out])
    for i, r in enumerate(out):
        row = ref[len(prompt_ids) - 1 + i]
        assert r.token_logprob == pytest.approx(row[r.token].item(), abs=1e-4)
        want = sorted(mx.topk(row, 5).tolist(), reverse=True)
        got = [a.logprob for a in r.top_logprobs]
        assert got == sorted(got, reverse=True)
        assert got == pytest.approx(want, abs=1e-4)
        for a in r.top_logprobs:
            assert a.logprob == pytest.approx(row[a.id].item(), abs=1e-4)
            assert a.bytes == vocab_for(tok).token_bytes(a.id)
        # The full vector is mlx-lm's: log-probabilities over the whole vocabulary.
        assert r.logprobs.shape == (row.shape[0],)
        assert mx.allclose(r.logprobs, row, atol=1e-4).item()
        for span in r.last_segment_tokens:
            assert span.logprob == pytest.approx(out[span.index].token_logprob)
        assert r.confidence == confidence_of(r.last_segment_tokens)
        if r.last_segment_tokens:
            lps = [t.logprob for t in r.last_segment_tokens]
            assert r.confidence is not None
            assert r.confidence.mean_logprob == pytest.approx(sum(lps) / len(lps))
            assert r.confidence.probability == pytest.approx(math.exp(sum(lps)))


def test_greedy_picks_the_top_alternative(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    out = collect(model, tok, "Once upon a time", max_tokens=8, top_logprobs=3)
    check_attribution(tok, out)
    plain = collect(model, tok, "Once upon a time", max_tokens=8)
    assert [r.token for r in plain] == [r.token for r in out]
    for r in plain:
        assert r.top_logprobs == []
        assert r.confidence == confidence_of(r.last_segment_tokens)
    for r in out:
        assert len(r.top_logprobs) == 3
        assert r.token_logprob == pytest.approx(r.top_logprobs[0].logprob)
    assert out[-1].finish_reason in ("length", "stop")


def test_seed_makes_sampling_reproducible(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    kw: dict[str, Any] = {"max_tokens": 12, "temp": 1.0, "top_p": 0.95}
    a = [r.token for r in collect(model, tok, "Hello", seed=11, **kw)]
    b = [r.token for r in collect(model, tok, "Hello", seed=11, **kw)]
    c = [r.token for r in collect(model, tok, "Hello", seed=12, **kw)]
    assert a == b
    assert a != c


def test_max_tokens_gives_length(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    no_eos = {e: -1e4 for e in tok.eos_token_ids}
    out = collect(model, tok, "Hi", max_tokens=5, temp=1.0, seed=0, logit_bias=no_eos)
    assert len(out) == 5
    assert out[-1].finish_reason == "length"
    check_attribution(tok, out)
    json.dumps([r.to_dict() for r in out])  # JSON-safe


def test_eos_ends_with_stop_and_is_reported(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    eos = next(iter(tok.eos_token_ids))
    for skip in (True, False):
        out = collect(
            model, tok, "Hi", max_tokens=5, logit_bias={eos: 1e4}, skip_special_tokens=skip
        )
        assert len(out) == 1
        (r,) = out
        assert (r.token, r.text, r.finish_reason) == (eos, "", "stop")
        assert [(t.index, t.id, t.start, t.end) for t in r.last_segment_tokens] == [
            (0, eos, 0, 0)
        ]


def test_chat_messages_use_the_chat_template(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    messages = [{"role": "user", "content": "What is a list?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    out = collect(model, tok, messages, max_tokens=6)
    assert out[0].prompt_tokens == len(ids)
    same = collect(model, tok, ids, max_tokens=6)
    assert [r.token for r in out] == [r.token for r in same]
    check_attribution(tok, out)


def test_breaking_out_stops_the_engine(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    inner = engine_for(model)
    pulled: list[int] = []
    state: dict[str, Any] = {}

    class Counting:
        name = "counting"
        vocab_size = inner.vocab_size
        context_length = inner.context_length

        def generate(self, ids: Sequence[int], params: SamplingParams, limit: int | None):
            try:
                for step in inner.generate(ids, params, limit):
                    pulled.append(step.token)
                    yield step
            finally:
                state["closed"] = True

        def peak_memory(self) -> float:
            return 0.0

    it = stream_generate(Counting(), tok, "Hello", max_tokens=50, temp=1.0, seed=1)
    for i, _ in enumerate(it):
        if i == 2:
            break
    it.close()
    assert len(pulled) == 3
    assert state["closed"]  # the engine's generator was closed, no more steps


@pytest.mark.parametrize("size", [7, 257, 1000, 32768, 50257])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_two_stage_top_k_finds_the_true_top_k(size: int, k: int) -> None:
    from tokentrail.engines.mlx.engine import top_k_ids

    k = min(k, size)
    mx.random.seed(size + k)
    for x in (
        mx.random.normal((2, size)),
        mx.random.randint(0, 4, (2, size)).astype(mx.float32),  # many ties
        mx.concatenate([mx.full((1, size - 1), -1e9), mx.zeros((1, 1))], axis=-1),
    ):
        ids = top_k_ids(x, k)
        assert ids.shape == (x.shape[0], k)
        for row in range(x.shape[0]):
            got = sorted(x[row][ids[row]].tolist(), reverse=True)
            want = sorted(x[row].tolist(), reverse=True)[:k]
            assert got == want
            assert len(set(ids[row].tolist())) == k


# -- a scripted engine: exact control over the ids, with the real tokenizer ---------------


class Scripted:
    """An Engine that replays fixed ids (logprob -1 each): tests the generation loop."""

    name = "scripted"
    context_length = None

    def __init__(self, ids: Sequence[int], vocab_size: int) -> None:
        self.ids = list(ids)
        self.vocab_size = vocab_size

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> Iterator[Step]:
        for n, i in enumerate(self.ids):
            if max_tokens is not None and n >= max_tokens:
                return
            yield Step(i, -1.0, [(i, -1.0)][: params.top_logprobs], None)

    def peak_memory(self) -> float:
        return 0.0


def test_padded_ids_are_left_out_of_alternatives(loaded: tuple[Any, Any]) -> None:
    _, tok = loaded
    size = len(vocab_for(tok).pieces)
    ids = tok.encode("hello there", add_special_tokens=False)

    class Padded(Scripted):  # a model whose embeddings run past the tokenizer's ids
        def generate(self, prompt_ids: Any, params: Any, max_tokens: Any) -> Iterator[Step]:
            for i in self.ids:
                yield Step(i, -1.0, [(i, -1.0), (size + 3, -2.0)], None)

    out = collect(Padded(ids, size + 64), tok, [1], top_logprobs=2, max_tokens=len(ids))
    assert [[a.id for a in r.top_logprobs] for r in out] == [[i] for i in ids]
    check_attribution(tok, out)


def test_eos_flushes_a_partial_character(loaded: tuple[Any, Any]) -> None:
    _, tok = loaded
    eos = next(iter(tok.eos_token_ids))
    # Without its last token the emoji is an incomplete character: EOS must flush it.
    for text in ("ok 🙂", "ok 龘", "ok 𝔘𝔫"):
        body = tok.encode(text, add_special_tokens=False)[:-1]
        if "\ufffd" in tok.decode(body):
            break
    else:
        pytest.skip("this tokenizer splits none of the sample characters across tokens")
    engine = Scripted([*body, eos], len(vocab_for(tok).pieces))
    out = collect(engine, tok, [1], max_tokens=20, top_logprobs=1)
    assert "".join(r.text for r in out) == tok.decode(body)
    assert out[-1].finish_reason == "stop"
    assert out[-1].last_segment_tokens[-1].id == eos
    assert {t.index for r in out for t in r.last_segment_tokens} == set(range(len(body) + 1))


def test_stop_string_trims_text_and_tokens(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    no_eos = {e: -1e4 for e in tok.eos_token_ids}
    kw: dict[str, Any] = {"max_tokens": 24, "temp": 1.0, "seed": 5, "logit_bias": no_eos}
    full = collect(model, tok, "Tell me", **kw)
    text = "".join(r.text for r in full)
    assert len(text) > 12
    stop = text[6:10]
    want = text[: text.find(stop)]
    out = collect(model, tok, "Tell me", stop=[stop, "\x00never"], **kw)
    assert "".join(r.text for r in out) == want
    last = out[-1]
    assert (last.finish_reason, last.stop_string) == ("stop", stop)
    assert [r.token for r in out] == [r.token for r in full[: len(out)]]
    pieces = vocab_for(tok).pieces
    carried = b"".join(pieces[t.id][t.start : t.end] for t in last.stop_tokens)
    assert carried.startswith(stop.encode())
    emitted = b"".join(
        pieces[t.id][t.start : t.end] for r in out for t in r.last_segment_tokens
    )
    assert emitted.decode() == want
    # Every generated token is accounted for: in the text, or in the stop string.
    seen = {t.index for r in out for t in r.last_segment_tokens} | {
        t.index for t in last.stop_tokens
    }
    assert seen == set(range(len(out)))


def test_an_engine_that_ends_early_is_an_error(loaded: tuple[Any, Any]) -> None:
    _, tok = loaded
    engine = Scripted(tok.encode("hi there", add_special_tokens=False), 10**6)
    with pytest.raises(RuntimeError, match="scripted engine stopped"):
        collect(engine, tok, [1], max_tokens=50)


def test_stop_string_split_inside_a_token(loaded: tuple[Any, Any]) -> None:
    _, tok = loaded
    ids = tok.encode(" hello world, again", add_special_tokens=False)
    engine = Scripted(ids, len(vocab_for(tok).pieces))
    out = collect(engine, tok, [1], stop="lo wo", top_logprobs=1)
    assert "".join(r.text for r in out) == " hel"
    assert out[-1].stop_string == "lo wo"
    pieces = vocab_for(tok).pieces
    carried = b"".join(pieces[t.id][t.start : t.end] for t in out[-1].stop_tokens)
    assert carried.startswith(b"lo wo")
    emitted = [t for r in out for t in r.last_segment_tokens]
    assert b"".join(pieces[t.id][t.start : t.end] for t in emitted) == b" hel"
    # The text and the stop string together are exactly the generated tokens' bytes.
    assert b" hel" + carried == b"".join(pieces[i] for i in ids[: len(out)])


# -- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -2}, "max_tokens"),
        ({"temp": -0.5}, "temp"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {10**9: 1.0}}, "logit_bias"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 10**9]}, "prompt"),
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": [{"content": "no role"}]}, "role"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_input_raises_naming_the_parameter(
    loaded: tuple[Any, Any], kwargs: dict[str, Any], message: str
) -> None:
    model, tok = loaded
    kw = {"prompt": "Hello", **kwargs}
    prompt = kw.pop("prompt")
    with pytest.raises((ValueError, TypeError), match=message):
        stream_generate(model, tok, prompt, **kw)


def test_unlimited_max_tokens_is_allowed(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    for limit in (None, -1):
        it = stream_generate(model, tok, "Hi", max_tokens=limit)
        first = next(it)
        it.close()
        assert first.generation_tokens == 1


# The context cap (only where the model would fail past its positions): test_context_cap.py


def test_unknown_model_path_and_architecture(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load(tmp_path / "no-such-model")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "not_a_real_arch"}))
    mx.save_safetensors(str(bad / "model.safetensors"), {"w": mx.zeros((1,))})
    with pytest.raises(ValueError, match="not_a_real_arch"):
        load(bad)
    with pytest.raises(ValueError, match="engine"):
        load(bad, engine="nope")


def test_mlx_lm_pair_and_plain_transformers_tokenizer(model_dir: Path) -> None:
    import mlx_lm

    model, wrapper = mlx_lm.load(str(model_dir))  # no tokentrail.load: config from model.args
    assert engine_for(model).context_length is not None
    no_eos = {e: -1e4 for e in wrapper.eos_token_ids}
    ours = collect(model, wrapper, "Hello", max_tokens=6, top_logprobs=2, logit_bias=no_eos)
    check_attribution(wrapper, ours)
    hf = wrapper._tokenizer  # a transformers tokenizer, as mlx-lm accepts too
    again = collect(model, hf, "Hello", max_tokens=6, top_logprobs=2, logit_bias=no_eos)
    assert [r.token for r in again] == [r.token for r in ours]
    assert [r.text for r in again] == [r.text for r in ours]
    messages = [{"role": "user", "content": "Hi"}]
    assert collect(model, hf, messages, max_tokens=2)[0].prompt_tokens == len(
        wrapper.apply_chat_template(messages, add_generation_prompt=True)
    )


def test_sampling_filters_and_penalties_run(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    for kw in (
        {"temp": 0.8, "top_k": 5, "seed": 1},
        {"temp": 0.8, "min_p": 0.1, "seed": 1},
        {"temp": 0.8, "top_p": 0.5, "seed": 1},
        {"repetition_penalty": 1.3},
    ):
        out = collect(model, tok, "Hello", max_tokens=6, top_logprobs=5, **kw)
        check_attribution(tok, out)
        if "top_k" in kw:  # sampled tokens come from the 5 most likely
            assert all(r.token in {a.id for a in r.top_logprobs} for r in out)


def test_load_none_is_the_demo_model() -> None:
    if not (DEMO_MODEL / "config.json").is_file():
        pytest.skip(f"demo model not installed at {DEMO_MODEL}")
    model, tok = load()
    out = collect(model, tok, "Hello", max_tokens=3)
    assert len(out) >= 1


def test_engine_for_rejects_what_no_engine_runs() -> None:
    with pytest.raises(TypeError, match="no engine can run"):
        engine_for(object())
    with pytest.raises(TypeError, match="no engine can run"):
        stream_generate(object(), None, "hi")


def test_lazy_exports() -> None:
    assert tokentrail.stream_generate is stream_generate
    assert tokentrail.GenerationResponse is GenerationResponse


# -- CLI -----------------------------------------------------------------------------


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `tokentrail generate` in a fresh interpreter (the lead's CLI when present)."""
    if (REPO / "src" / "tokentrail" / "cli.py").is_file():
        cmd = [sys.executable, "-m", "tokentrail", "generate", *args]
    else:
        shim = (
            "import argparse, sys\n"
            "from tokentrail.generate_cli import register\n"
            "p = argparse.ArgumentParser(prog='tokentrail')\n"
            "register(p.add_subparsers(dest='command', required=True))\n"
            "a = p.parse_args()\n"
            "sys.exit(a.func(a))\n"
        )
        cmd = [sys.executable, "-c", shim, "generate", *args]
    return subprocess.run(
        cmd, input=stdin, capture_output=True, text=True, timeout=300, cwd=REPO, check=False
    )


def test_cli_json_lines(model_dir: Path) -> None:
    res = run_cli(
        "Hello there", "--model", str(model_dir), "--max-tokens", "6", "--json",
        "--top-logprobs", "2", "--seed", "1", "--temp", "0.8",
    )
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert 1 <= len(rows) <= 6
    assert rows[-1]["finish_reason"] in ("length", "stop")
    for row in rows:
        assert set(row) >= {"text", "token", "last_segment_tokens", "confidence", "finish_reason"}
    _, tok = load(model_dir)
    ids = [row["token"] for row in rows]
    body = ids[:-1] if ids[-1] in tok.eos_token_ids else ids
    assert "".join(row["text"] for row in rows) == tok.decode(body, skip_special_tokens=True)


def cli_args(*argv: str) -> Any:
    import argparse

    from tokentrail.generate_cli import register

    parser = argparse.ArgumentParser(prog="tokentrail")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["generate", *argv])


def test_cli_chat_in_process(
    model_dir: Path, loaded: tuple[Any, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from tokentrail.generate_cli import run

    args = cli_args("What is a list?", "--chat", "--model", str(model_dir), "--max-tokens",
                    "4", "--json")
    assert run(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    _, tok = loaded
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is a list?"}], add_generation_prompt=True
    )
    assert rows[0]["prompt_tokens"] == len(ids)


def test_cli_colours_segments_and_prints_model_text_verbatim(
    loaded: tuple[Any, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import re

    from tokentrail.generate_cli import show

    _, tok = loaded
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    text = "[bold red]not markup[/bold red] x"
    ids = tok.encode(text, add_special_tokens=False)
    engine = Scripted(ids, len(vocab_for(tok).pieces))
    assert show(stream_generate(engine, tok, [1], top_logprobs=2, max_tokens=len(ids))) == 0
    out = capsys.readouterr().out
    assert "\x1b[" in out  # coloured
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert plain.startswith(text + "\n")
    assert "tokens/s" in plain and "least confident" in plain


def test_cli_prompt_from_stdin(model_dir: Path) -> None:
    res = run_cli("--model", str(model_dir), "--max-tokens", "3", "--json", stdin="Hello\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()


@pytest.mark.parametrize(
    "args",
    [
        ["Hi", "--max-tokens", "0"],
        ["Hi", "--temp", "-1"],
        ["Hi", "--top-p", "2"],
        ["Hi", "--top-logprobs", "99"],
        ["Hi", "--model", "/definitely/not/a/model"],
        ["Hi", "--max-tokens", "abc"],
    ],
)
def test_cli_bad_input_exits_2_with_one_line(model_dir: Path, args: list[str]) -> None:
    if "--model" not in args:
        args = [*args, "--model", str(model_dir)]
    res = run_cli(*args, stdin="")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
