"""tokentrail.realign on our own server's streams: a real `tokentrail serve` on loopback,
read through the openai client, realigned with and without its extension.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import require
from tests.helpers.models import build_tiny_llama
from tests.helpers.realigned import attributed, span_key
from tests.helpers.servers import start_server
from tokentrail import load_vocab
from tokentrail.realign import realign

# -- our own server, on loopback ---------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    """tokentrail's server on a tiny random-weight byte-level model (partial UTF-8 galore)."""
    require("mlx_lm")
    require("uvicorn")
    require("openai")
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("realign-model"))
    server = start_server(model_dir, tmp_path_factory.mktemp("logs") / "realign.log")
    yield server, model_dir
    server.stop()


def _client(server: Any) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _strip(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in c.items() if k != "tokentrail"} for c in chunks]


def _ext_key(chunks: list[dict[str, Any]]) -> list[tuple[str, list[tuple[int, int, int, int]]]]:
    return [
        (s["text"], [(t["index"], t["id"], t["start"], t["end"]) for t in s["tokens"]])
        for c in chunks
        for s in (c.get("tokentrail") or {}).get("segments", [])
    ]


def test_own_server_chat_stream_realigns_with_and_without_its_extension(served: Any) -> None:
    server, model_dir = served
    vocab = load_vocab(model_dir)
    stream = _client(server).chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=48,
        stream=True,
        logprobs=True,
        top_logprobs=2,
        temperature=1.0,
        seed=11,
    )
    chunks = [c.model_dump() for c in stream]
    content = "".join(
        (c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"]
    )
    with_ext = realign(chunks, vocab)
    assert with_ext.source == "tokentrail-extension"
    assert with_ext.extension_agrees is True and with_ext.exact, with_ext.summary()
    assert with_ext.text == content
    # The standard logprobs carry raw bytes: realigning them alone gives the same segments.
    plain = realign(_strip(chunks), vocab)
    assert plain.source == "logprob-bytes"
    assert plain.exact, plain.summary()
    assert span_key(plain.segments) == _ext_key(chunks)
    spans = [t for s in plain.segments for t in s.tokens]
    assert all(t.top_logprobs is not None and len(t.top_logprobs) == 2 for t in spans)
    # The same request not streamed: one response, realigned the same way.
    whole = _client(server).chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=48,
        logprobs=True,
        top_logprobs=2,
        temperature=1.0,
        seed=11,
    )
    for chunk in ([whole.model_dump()], _strip([whole.model_dump()])):
        result = realign(chunk, vocab)
        assert result.exact, result.summary()
        assert span_key(result.segments) == span_key(plain.segments)


def test_own_server_completion_token_strings_are_lossless(served: Any) -> None:
    """/v1/completions names a token that is not UTF-8 alone in OpenAI's `bytes:\\xNN`
    form, so realign recovers every id without the extension; a U+FFFD stand-in would be
    refused."""
    server, model_dir = served
    vocab = load_vocab(model_dir)
    stream = _client(server).completions.create(
        model=server.model,
        prompt="Once",
        max_tokens=48,
        stream=True,
        logprobs=1,
        seed=5,
        temperature=1.0,
    )
    chunks = [c.model_dump() for c in stream]
    with_ext = realign(chunks, vocab)
    assert with_ext.exact, with_ext.summary()
    ids = {t.index: t.id for s in with_ext.segments for t in s.tokens}
    plain = realign(_strip(chunks), vocab)
    assert plain.text == plain.content == with_ext.text
    names = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    stand_ins = {k for k, name in enumerate(names) if "\ufffd" in name}
    assert {r.index for r in plain.refused} == stand_ins
    assert plain.lossy == bool(stand_ins)
    assert not stand_ins and plain.exact, plain.summary()
    assert any(name.startswith("bytes:") for name in names) or all(
        vocab.pieces[i] is not None and vocab.texts[i] is not None for i in ids.values()
    )
    assert all(ids[i] == t for i, t in attributed(plain).items())


def test_own_server_stop_string_agrees_with_the_extension(served: Any) -> None:
    server, model_dir = served
    vocab = load_vocab(model_dir)
    client = _client(server)
    kw = {"model": server.model, "prompt": "Go", "max_tokens": 40, "seed": 9, "temperature": 0.0}
    free = client.completions.create(**kw).choices[0].text
    stop = next((free[k : k + 2] for k in range(3, len(free) - 2) if free[k : k + 2].strip()), None)
    if stop is None or "\ufffd" in stop:
        pytest.skip(f"no usable stop string in {free!r}")
    chunks = [c.model_dump() for c in client.completions.create(**kw, stop=[stop], stream=True)]
    result = realign(chunks, vocab)
    assert result.text == result.content == free[: free.index(stop)]
    assert result.exact, result.summary()
    assert result.extension_agrees is True
    plain = realign(_strip(chunks), vocab)
    assert plain.text == result.text
