"""The vLLM engine: Step stream from vLLM's per-token logprobs, on vLLM itself.

The engine tests need vLLM: on a CUDA GPU where vLLM is installed here, or on CPU in
the venv `scripts/setup_vllm.sh` makes (vLLM's CPU build, `.venv-vllm`; `.ci/run` sets
`TOKENTRAIL_VLLM_PYTHON` to its python), where `test_the_engine_tests_pass_in_the_vllm_venv`
runs this module. They run the demo model in float32 and compare with the PyTorch engine
and with an independent full forward pass in transformers, on the same device. Without
vLLM, the tests here check that `load` says how to install it, and the conversion of
vLLM's logprob records to Steps.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import require
from tests.helpers.models import build_tiny_llama, gpt2_tokenizer_json
from tokentrail.engines import vllm_engine as ve
from tokentrail.generate import DEMO_MODEL
from tokentrail.sampling import make_params

REPO = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
PROMPTS = ["The quick brown fox", "def main():\n    ", "Zürich ist schön, 東京も"]


# -- without vLLM ----------------------------------------------------------------------


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_missing_vllm_raises_a_clear_import_error(tmp_path: Path) -> None:
    with pytest.raises(ImportError, match="pip install vllm"):
        ve.load(tmp_path)
    assert not ve.accepts(object())


@dataclass
class Record:
    """The fields tokentrail reads from vLLM's `Logprob` (vllm.logprobs.Logprob)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_class() -> Any:
    if HAS_VLLM:
        from vllm.logprobs import Logprob

        return Logprob
    return Record


def test_step_from_a_position_with_the_sampled_token_outside_the_top_k() -> None:
    lp = logprob_class()
    # vLLM returns the top 2 plus the sampled token (rank 5), in no particular order.
    position = {7: lp(-0.5, 1), 3: lp(-3.25, 5), 9: lp(-1.5, 2)}
    step = ve.step_from_logprobs(3, position, 2)
    assert (step.token, step.logprob) == (3, -3.25)
    assert step.top_logprobs == [(7, -0.5), (9, -1.5)]
    assert step.logprobs is None


def test_step_with_no_alternatives_and_with_ties() -> None:
    lp = logprob_class()
    assert ve.step_from_logprobs(4, {4: lp(-0.25, 1)}, 0).top_logprobs == []
    tied = {1: lp(-1.0, 1), 2: lp(-1.0, 1), 3: lp(-2.0, 3)}
    assert len(ve.step_from_logprobs(1, tied, 1).top_logprobs) == 1
    with pytest.raises(RuntimeError, match="no logprob"):
        ve.step_from_logprobs(5, {4: lp(-0.25, 1)}, 0)


# -- with vLLM: its CPU build in the vLLM venv, or a GPU ----------------------------------

#: How the engine tests run on vLLM's CPU build: float32 (its CPU build picks bfloat16
#: for "auto"), eager, 1 GiB of KV cache (its CPU default is far more than CI has).
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def test_the_engine_tests_pass_in_the_vllm_venv() -> None:
    """Where vLLM is not importable (the project's venv), this module's engine tests run
    in the vLLM venv on its CPU build, with pytest there; every one must pass, none
    skip."""
    import os
    import re
    import subprocess

    if HAS_VLLM:
        pytest.skip("vLLM is importable here: the engine tests below run directly")
    from tests.test_vllm_server import vllm_python

    python = vllm_python()
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", __file__,
           "-k", "not in_the_vllm_venv and not missing_vllm"]  # fmt: skip
    env = {**os.environ, **CPU_ENV}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    # pytest's own summary line ("15 passed, 2 deselected, 14 warnings in 62.63s"), read
    # from its output alone: what the process prints as it exits (triton's nanobind
    # reports its leaks there, "... skipped remainder" among them) is not pytest's word.
    counts = re.findall(r"^=*\s*(\d+ passed[^\n]*?) in [\d.]+s", done.stdout, re.MULTILINE)
    assert counts, tail
    assert int(counts[-1].split()[0]) >= 15, tail
    assert "skipped" not in counts[-1] and "failed" not in counts[-1], tail
    assert "SKIPPED [" not in done.stdout, tail  # -rs lists every skip


@pytest.fixture(scope="module")
def device() -> str:
    require("vllm", "scripts/setup_vllm.sh installs its CPU build into .venv-vllm, where "
                    "test_the_engine_tests_pass_in_the_vllm_venv runs these tests")
    torch = require("torch")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model_dir(device: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if (DEMO_MODEL / "model.safetensors").is_file():
        return DEMO_MODEL
    tok = gpt2_tokenizer_json()
    # 64-wide heads: every vLLM attention backend has them.
    return build_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama-vllm"), tok, framework="torch", hidden_size=128,
        intermediate_size=256, heads=2, kv_heads=1, context=512, rms_norm_eps=1e-6,
        chat_template=None,
    )


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[ve.VLLMEngine, Any]]:
    engine, tok = ve.load(
        model_dir, dtype="float32", gpu_memory_utilization=0.25, enforce_eager=True
    )
    yield engine, tok
    engine.shutdown()


@pytest.fixture(scope="module")
def torch_model(model_dir: Path, device: str) -> Any:
    from tokentrail.engines.torch_engine import load

    return load(model_dir, device=device, dtype="float32")[0]


def reference_logprobs(model: Any, ids: list[int]) -> Any:
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=model.device), use_cache=False)
    return torch.log_softmax(logits.logits[0].float(), dim=-1).cpu()


def test_engine_metadata(served: tuple[ve.VLLMEngine, Any], model_dir: Path) -> None:
    from tokentrail.engines import Engine

    engine, tok = served
    config = json.loads((model_dir / "config.json").read_text())
    assert isinstance(engine, Engine)
    assert engine.vocab_size == config["vocab_size"]
    assert engine.context_length == config["max_position_embeddings"]
    assert tok.eos_token_id in tok.eos_token_ids


def test_greedy_gives_the_same_tokens_as_the_torch_engine(
    served: tuple[ve.VLLMEngine, Any], torch_model: Any
) -> None:
    from tokentrail.engines.torch_engine import TorchEngine

    engine, tok = served
    reference = TorchEngine(torch_model)
    for prompt in PROMPTS:
        ids = tok.encode(prompt, add_special_tokens=False)
        ours = list(engine.generate(ids, make_params(top_logprobs=3), 40))
        theirs = list(reference.generate(ids, make_params(top_logprobs=3), 40))
        assert [s.token for s in ours] == [s.token for s in theirs], prompt


def test_logprobs_and_top_k_match_a_full_forward_pass(
    served: tuple[ve.VLLMEngine, Any], torch_model: Any
) -> None:
    import torch

    engine, tok = served
    ids = tok.encode(PROMPTS[0], add_special_tokens=False)
    steps = list(engine.generate(ids, make_params(temp=1.0, seed=3, top_logprobs=5), 24))
    assert len(steps) == 24
    ref = reference_logprobs(torch_model, ids + [s.token for s in steps])
    for i, s in enumerate(steps):
        row = ref[len(ids) - 1 + i]
        assert s.logprobs is None  # vLLM returns no full vector
        assert s.logprob == pytest.approx(row[s.token].item(), abs=2e-3)
        lps = [lp for _, lp in s.top_logprobs]
        assert lps == sorted(lps, reverse=True) and len(lps) == 5
        assert lps == pytest.approx(torch.topk(row, 5).values.tolist(), abs=2e-3)
        for t, lp in s.top_logprobs:
            assert lp == pytest.approx(row[t].item(), abs=2e-3)


def test_seed_makes_sampling_reproducible(served: tuple[ve.VLLMEngine, Any]) -> None:
    engine, tok = served
    ids = tok.encode(PROMPTS[1], add_special_tokens=False)

    def sample(seed: int) -> list[int]:
        return [s.token for s in engine.generate(ids, make_params(temp=1.5, seed=seed), 16)]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_stream_generate_on_vllm(served: tuple[ve.VLLMEngine, Any]) -> None:
    from tokentrail import stream_generate

    engine, tok = served
    for prompt in PROMPTS:
        out = list(stream_generate(engine, tok, prompt, max_tokens=40, top_logprobs=2))
        ids = [r.token for r in out]
        body = ids[:-1] if ids[-1] in tok.eos_token_ids else ids
        assert "".join(r.text for r in out) == tok.decode(body, skip_special_tokens=True)
        spans = [t for r in out for t in r.last_segment_tokens]
        assert sorted({t.index for t in spans}) == list(range(len(ids)))
        assert out[-1].finish_reason in ("length", "stop")
        json.dumps([r.to_dict() for r in out])


def test_end_token_stops_generation(served: tuple[ve.VLLMEngine, Any]) -> None:
    from tokentrail import stream_generate

    engine, tok = served
    eos = tok.eos_token_id
    out = list(stream_generate(engine, tok, "Hi", max_tokens=5, logit_bias={eos: 1e4}))
    assert [(r.token, r.text, r.finish_reason) for r in out] == [(eos, "", "stop")]


def test_closing_aborts_the_request(served: tuple[ve.VLLMEngine, Any]) -> None:
    engine, tok = served
    ids = tok.encode(PROMPTS[0], add_special_tokens=False)
    gen = engine.generate(ids, make_params(temp=1.0, seed=0), 2000)
    for i, _ in enumerate(gen):
        if i == 2:
            break
    gen.close()
    with pytest.raises(StopIteration):
        next(gen)
    processor = getattr(engine.engine, "output_processor", None)
    if processor is not None and hasattr(processor, "get_num_unfinished_requests"):
        deadline = time.monotonic() + 30  # a bound on waiting, not a timing assertion
        while processor.get_num_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processor.get_num_unfinished_requests() == 0
    # The engine still serves after an abort.
    assert len(list(engine.generate(ids, make_params(), 4))) == 4


def test_concurrent_streams_get_their_own_tokens(served: tuple[ve.VLLMEngine, Any]) -> None:
    engine, tok = served
    alone = {
        p: [s.token for s in engine.generate(tok.encode(p), make_params(), 24)] for p in PROMPTS
    }
    together: dict[str, list[int]] = {}

    def work(prompt: str) -> None:
        together[prompt] = [s.token for s in engine.generate(tok.encode(prompt), make_params(), 24)]

    threads = [threading.Thread(target=work, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone


@pytest.mark.parametrize(
    ("ids", "limit", "error", "message"),
    [
        ([], 4, ValueError, "empty"),
        ([1, -1], 4, ValueError, "token id -1"),
        ([1, 10**9], 4, ValueError, "outside the vocabulary"),
        ([1, 2], 0, ValueError, "max_tokens"),
    ],
)
def test_bad_input_raises_at_the_call(
    served: tuple[ve.VLLMEngine, Any], ids: list[int], limit: int, error: type, message: str
) -> None:
    engine, _ = served
    with pytest.raises(error, match=message):
        engine.generate(ids, make_params(), limit)


def test_offline_llm_is_wrapped(model_dir: Path, served: tuple[ve.VLLMEngine, Any]) -> None:
    from vllm import LLM

    from tokentrail.engines import ENGINES, engine_for

    engine, tok = served
    llm = LLM(
        model=str(model_dir), dtype="float32", gpu_memory_utilization=0.25, enforce_eager=True
    )
    try:
        assert ve.accepts(llm)
        offline = engine_for(llm) if "vllm" in ENGINES else ve.wrap(llm)
        assert isinstance(offline, ve.VLLMEngine)
        ids = tok.encode(PROMPTS[0], add_special_tokens=False)
        a = [s.token for s in offline.generate(ids, make_params(top_logprobs=2), 24)]
        b = [s.token for s in engine.generate(ids, make_params(top_logprobs=2), 24)]
        assert a == b
        gen = offline.generate(ids, make_params(), 100)
        next(gen)
        gen.close()  # aborts; the LLM is free again
        assert len(list(offline.generate(ids, make_params(), 3))) == 3
    finally:
        del llm
