"""The llama.cpp batch's prompt cache (llama-server's `--cache-ram`, and its slot reuse
with `--cache-ram 0`), on real GGUF models.

A finished sequence's KV state is saved to host memory and leaves the KV cache (or, with
`prompt_cache_bytes=0`, its cells stay in its llama.cpp sequence); the next prompt that
shares a prefix with it evaluates only the rest. Oracles: llama-cpp-python's own greedy decode
on an independent `Llama` over the same file (`Llama.generate`, which evaluates the whole
prompt cold), and the batch's own cold run (a fresh batch) for logprobs; cached counts
follow from what llama.cpp's KV cells hold (a sequence's last sampled token is never
evaluated). Served: `usage.prompt_tokens_details.cached_tokens` through the official
`openai` client on a real `tokentrail serve --engine llamacpp` process.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.env import require
from tests.helpers.net import free_port
from tests.helpers.servers import launch
from tokentrail.sampling import make_params

PROMPTS = [
    "The capital of France is",
    "The capital of France is Paris, and the capital of Italy is",
    "東京は日本の首都で、",
    "def fibonacci(n):\n    ",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def ref_greedy(ref: Any, ids: list[int], n: int) -> list[int]:
    """llama-cpp-python's own greedy decode of `ids`, cold (its KV cache reset first)."""
    ref.reset()
    out = []
    for tok in ref.generate(
        ids, temp=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, reset=True
    ):
        out.append(int(tok))
        if len(out) == n:
            break
    return out


def run(batch: Any, ids: list[int], n: int, **params: Any) -> tuple[list[Any], int]:
    """One sequence through `batch` to its end: its steps and its cached prompt tokens."""
    uid = batch.add(ids, make_params(**params), n)
    steps = []
    while len(batch):
        steps += [s for u, s in batch.step() if u == uid]
    return steps, batch.cached_tokens(uid)


#: The batch's two prompt caches: host memory (the default) and idle cells kept in the KV cache.
CACHES = [pytest.param(None, id="host-memory"), pytest.param(0, id="kv-cells")]


@pytest.mark.parametrize("cache", CACHES)
def test_a_repeated_prompt_reuses_all_but_its_last_token(
    demo: Any, demo_ref: Any, cache: int | None
) -> None:
    engine, tok = demo
    ids = tok.encode(PROMPTS[1])
    want = ref_greedy(demo_ref, ids, 8)
    batch = engine.open_batch(2, n_ctx=512, prompt_cache_bytes=cache)
    cold, cached_cold = run(batch, ids, 8, top_logprobs=3)
    warm, cached_warm = run(batch, ids, 8, top_logprobs=3)
    batch.close()
    assert cached_cold == 0
    assert cached_warm == len(ids) - 1  # the last prompt token is run again for its logits
    assert [s.token for s in cold] == [s.token for s in warm] == want
    for a, b in zip(cold, warm, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [i for i, _ in a.top_logprobs] == [i for i, _ in b.top_logprobs]


@pytest.mark.parametrize("cache", CACHES)
def test_a_follow_up_reuses_the_prompt_and_the_reply(
    demo: Any, demo_ref: Any, cache: int | None
) -> None:
    """A chat's next turn: the previous prompt and all but the last generated token (the
    one never evaluated) come from the cache; the new ids equal a cold decode."""
    engine, tok = demo
    first = tok.encode(PROMPTS[0])
    batch = engine.open_batch(1, n_ctx=512, prompt_cache_bytes=cache)
    out = [s.token for s in run(batch, first, 5)[0]]
    follow = [*first, *out, *tok.encode(" and the river")]
    steps, cached = run(batch, follow, 6)
    batch.close()
    assert cached == len(first) + len(out) - 1
    assert [s.token for s in steps] == ref_greedy(demo_ref, follow, 6)


@pytest.mark.parametrize("cache", CACHES)
def test_a_new_prompt_takes_the_slot_with_the_longest_shared_prefix(
    demo: Any, cache: int | None
) -> None:
    engine, tok = demo
    short, longer, other = (tok.encode(p) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[3]))
    assert longer[: len(short)] == short
    batch = engine.open_batch(3, n_ctx=512, prompt_cache_bytes=cache)
    run(batch, other, 2)
    run(batch, short, 2)
    _, cached = run(batch, longer, 2)  # the slot that holds `short` (not the LRU one)
    batch.close()
    assert cached == len(short)


def test_a_full_cache_frees_idle_slots_instead_of_failing(demo: Any) -> None:
    """Without the host-memory cache (`prompt_cache_bytes=0`, llama-server's
    `--cache-ram 0`) idle sequences' cells fill the shared KV cache; a new prompt that
    needs the room frees them and still decodes exactly what it decodes alone."""
    engine, tok = demo
    batch = engine.open_batch(3, n_ctx=512, prompt_cache_bytes=0)
    words = ("Alpha", "Bravo", "Charlie")
    prompts = [tok.encode(f"{w} story: " + "the quick brown fox jumps " * 16) for w in words]
    n = max(len(p) for p in prompts) + 4
    assert 2 * n < batch.n_ctx < 3 * n  # two idle caches leave no room for the third
    solo = []
    for p in prompts:
        fresh = engine.open_batch(1, n_ctx=512)
        solo.append([s.token for s in run(fresh, p, 4)[0]])
        fresh.close()
    got = [[s.token for s in run(batch, p, 4)[0]] for p in prompts]
    assert got == solo
    _, cached = run(batch, prompts[0], 1)  # its cells were freed: only the third's remain
    batch.close()
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[2], strict=False)) if a != b)
    assert cached == shared


def test_finished_sequences_leave_the_kv_cache_and_return_from_host_memory(
    demo: Any, demo_ref: Any
) -> None:
    """With the host-memory cache (the default) a finished sequence's cells leave the KV
    cache before the next decode, so the sequences still decoding attend over their own
    cells only (llama.cpp's attention spans the unified cache up to its highest used
    cell); a later prompt that shares its prefix gets the cells back from host memory
    and decodes what it decodes cold."""
    engine, tok = demo
    prompts = [tok.encode(p) for p in PROMPTS]
    batch = engine.open_batch(4, n_ctx=1024)
    uids = [batch.add(p, make_params(), 3 + k) for k, p in enumerate(prompts)]
    while len(batch):
        live = len(batch)
        batch.step()
        finished = live - len(batch)  # left in this step: cells held until the next one
        assert sum(pos >= 0 for pos in batch.kv_positions()) == len(batch) + finished
    assert batch.saved_bytes > 0
    assert [batch.cached_tokens(u) for u in uids] == [0] * 4
    for k in (2, 0):  # the last sequence to finish held prompts[3]: these come from memory
        uid = batch.add(prompts[k], make_params(), 5)
        assert batch.cached_tokens(uid) == len(prompts[k]) - 1
        steps = []
        while len(batch):
            steps += [s for _, s in batch.step()]
            assert sum(pos >= 0 for pos in batch.kv_positions()) == 1
        assert [s.token for s in steps] == ref_greedy(demo_ref, prompts[k], 5)
    batch.close()


def test_requests_one_after_another_decode_what_they_decode_cold(smol: tuple[Any, Any]) -> None:
    """SmolLM2 in a unified cache of 4 sequences: a prompt whose prefix comes back from
    host memory after another prompt used the cache decodes the tokens and logprobs it
    decodes cold. Before, it was restored beside the other's idle cells, those left the
    cache at the next step, llama.cpp put its next tokens in the freed cells before its
    earlier ones, and its first logprob moved by 0.05 and its fourth token changed
    ("Bananas" for "Banana", found through `serve`). With the cache split, the same
    holds beside a sequence still decoding (a unified cache's sequences depend on each
    other, docs/engines.md)."""
    engine, tok = smol
    ask = tok.apply_chat_template([{"role": "user", "content": "List five fruits, one per line."}])
    other = tok.apply_chat_template(
        [{"role": "user", "content": "Write the word 'apple' ten times, one per line."}]
    )
    p = {"top_logprobs": 2}
    got: list[tuple[list[Any], list[Any]]] = []
    for unified in (True, False):
        cold, _ = run(engine.open_batch(4, n_ctx=8192, kv_unified=unified), ask, 8, **p)
        cold_other, _ = run(engine.open_batch(4, n_ctx=8192, kv_unified=unified), other, 16, **p)
        batch = engine.open_batch(4, n_ctx=8192, kv_unified=unified)
        run(batch, ask, 8, **p)
        run(batch, other, 12, **p)
        again, cached = run(batch, ask, 8, **p)
        assert cached == len(ask) - 1
        got.append((again, cold))
        if unified:
            batch.close()
            continue
        # `ask` joins first, ends early and comes back while `other` goes on decoding
        first = batch.add(ask, make_params(**p), 3)
        long = batch.add(other, make_params(**p), 16)
        steps_long = []
        while batch.holds(first):
            steps_long += [s for u, s in batch.step() if u == long]
        beside = batch.add(ask, make_params(**p), 8)
        steps = []
        while len(batch):
            for u, s in batch.step():
                (steps if u == beside else steps_long).append(s)
        assert batch.cached_tokens(beside) == len(ask) - 1
        batch.close()
        got += [(steps, cold), (steps_long, cold_other)]
    for steps, want in got:
        assert [s.token for s in steps] == [s.token for s in want]
        for a, b in zip(steps, want, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=2e-3)


def test_the_host_cache_drops_the_least_recently_used_past_its_bound(demo: Any) -> None:
    engine, tok = demo
    prompts = [tok.encode(p) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[3])]
    sizes = []
    for p in prompts:  # each prompt's saved state alone
        one = engine.open_batch(1, n_ctx=512)
        run(one, p, 4)
        sizes.append(one.saved_bytes)
        one.close()
    assert min(sizes) > 0
    batch = engine.open_batch(1, n_ctx=512, prompt_cache_bytes=sizes[1] + sizes[2])
    for p in prompts:
        run(batch, p, 4)
    assert batch.saved_bytes == sizes[1] + sizes[2]  # the first one made room
    assert run(batch, prompts[2], 4)[1] == len(prompts[2]) - 1
    assert run(batch, prompts[1], 4)[1] == len(prompts[1]) - 1
    assert run(batch, prompts[0], 4)[1] == 0
    batch.close()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8G"])
def test_a_bad_prompt_cache_bound_is_refused_by_name(demo: Any, bad: Any) -> None:
    engine, _ = demo
    with pytest.raises(ValueError, match="prompt_cache_bytes"):
        engine.open_batch(1, n_ctx=512, prompt_cache_bytes=bad)


POOL = [
    "The capital of France is",
    "The capital of France is a city",
    "The capital of Spain is",
    "def add(a, b):",
    "def add(a, b):\n    return",
]


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    order=st.lists(st.integers(0, len(POOL) - 1), min_size=2, max_size=6),
    width=st.integers(1, 3),
    cache=st.sampled_from([None, 0, 60_000]),
)
def test_any_order_of_prompts_decodes_what_each_decodes_cold(
    demo: Any, cold_ids: dict[int, list[int]], order: list[int], width: int, cache: int | None
) -> None:
    """Prompts sharing prefixes, joining `width` at a time in any order, with either
    cache (host memory unbounded or bounded to about one state, or cells kept in the KV
    cache): every sequence's greedy ids equal llama-cpp-python's cold decode of its
    prompt."""
    engine, tok = demo
    batch = engine.open_batch(width, n_ctx=1024, prompt_cache_bytes=cache)
    todo = list(order)
    got: dict[int, tuple[int, list[int]]] = {}
    while todo or len(batch):
        while todo and len(batch) < width:
            k = todo.pop(0)
            got[batch.add(tok.encode(POOL[k]), make_params(), 6)] = (k, [])
        for uid, s in batch.step():
            got[uid][1].append(s.token)
    batch.close()
    for k, ids in got.values():
        assert ids == cold_ids[k], POOL[k]


@pytest.fixture(scope="module")
def cold_ids(demo: Any, demo_ref: Any) -> dict[int, list[int]]:
    _, tok = demo
    return {k: ref_greedy(demo_ref, tok.encode(p), 6) for k, p in enumerate(POOL)}


# -- served: usage.prompt_tokens_details.cached_tokens ------------------------------------------


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require("uvicorn")
    port = free_port()
    log = tmp_path_factory.mktemp("llamacpp-cache") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "tokentrail",
        "serve",
        "--engine",
        "llamacpp",
        "--model",
        str(smollm2_gguf),
        "--n-ctx",
        "2048",
        "--max-batch",
        "2",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    srv = launch(cmd, log, f"http://127.0.0.1:{port}", timeout=180.0)
    yield srv.url
    srv.stop()


def test_the_server_reports_cached_prompt_tokens(server: str, smol_ref: Any) -> None:
    openai = require("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    kw: dict[str, Any] = {"model": model, "messages": CHAT, "temperature": 0, "max_tokens": 12}
    first = client.chat.completions.create(**kw)
    second = client.chat.completions.create(**kw)
    ref = smol_ref.create_chat_completion(CHAT, max_tokens=12, temperature=0.0)
    want = ref["choices"][0]["message"]["content"]
    assert first.choices[0].message.content == second.choices[0].message.content == want
    n = first.usage.prompt_tokens
    assert n == ref["usage"]["prompt_tokens"]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == n - 1
    stream = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage and usage[-1].prompt_tokens_details.cached_tokens == n - 1
