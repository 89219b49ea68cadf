"""LM Studio's MLX engine (lmstudio-ai/mlx-engine, unmodified) with tokentrail swapped in.

The peer's real `create_generator` runs on the demo model and on SmolLM2 (its GGUF made
an MLX folder by `tokentrail.engines.gguf_models`), sequential (`ModelKit`) and batched
(`BatchedVisionModelKit`), once unchanged (the oracle) and once with tokentrail in:

* sequential: `mlx_engine.generate.stream_generate` is `tokentrail.stream_generate` with
  `align_to_prompt=False, skip_special_tokens=False, whole_tokens=True`, and the
  responses it yields, mapped field by field (`lmstudio_results`, the recipe in
  docs/mlx-lm.md), must give the peer's own results;
* batched: `tokentrail.detokenizer.install(kit, like_mlx_lm=True, whole_tokens=True)`,
  each request's detokenizer fed `add_token(token, logprob, top)`.

The peer is found at ``../shared/peers/mlx-engine`` (or ``TOKENTRAIL_MLX_ENGINE``), with
its dependencies from ``pip install -e '.[lmstudio]'``; without them the tests skip
saying so, and with ``CI=true`` they fail.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import require

REPO = Path(__file__).resolve().parents[1]
PEER = Path(
    os.environ.get("TOKENTRAIL_MLX_ENGINE", REPO.parent / "shared" / "peers" / "mlx-engine")
)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
JSON_SCHEMA = (
    '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, '
    '"required": ["name"]}'
)
METAL_ONLY = (
    "batched json_schema runs mlx-vlm's llguidance mask kernel (mx.fast.metal_kernel): "
    "on Linux it fails inside mlx-vlm with 'RuntimeError: [metal_kernel] No Metal "
    "back-end', with or without tokentrail"
)


def _missing(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def peer() -> Iterator[Any]:
    """`mlx_engine.generate`, imported from the peer's checkout."""
    require("mlx_lm")
    if not (PEER / "mlx_engine" / "generate.py").is_file():
        _missing(
            f"LM Studio's mlx-engine is not at {PEER} (lmstudio-ai/mlx-engine; set "
            "TOKENTRAIL_MLX_ENGINE to its checkout)"
        )
    for module in ("mlx_vlm", "outlines", "llguidance"):
        try:
            __import__(module)
        except ImportError:
            _missing(
                f"{module} is not installed (mlx-engine needs it): pip install -e '.[lmstudio]'"
            )
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(PEER))
        import mlx_engine.generate

        yield mlx_engine.generate


@pytest.fixture(scope="module", params=["demo", "smollm2"])
def model_path(request: pytest.FixtureRequest) -> Path:
    if request.param == "demo":
        from tokentrail.generate import DEMO_MODEL

        return DEMO_MODEL
    from tokentrail.engines.gguf_models import mlx_folder_from_gguf
    from tokentrail.models import ModelNotAvailable, resolve

    require("torch")
    try:
        gguf = resolve("smollm2")
    except ModelNotAvailable as e:
        _missing(str(e))
    return mlx_folder_from_gguf(gguf)


def _tokenizer(path: Path) -> Any:
    from mlx_lm.tokenizer_utils import load

    return load(path)


def _kit(peer: Any, path: Path, batched: bool) -> Any:
    kit = peer.load_model(path, max_seq_nums=4 if batched else 1, enable_disk_cache=False)
    want = "BatchedVisionModelKit" if batched else "ModelKit"
    assert type(kit).__name__ == want
    return kit


def _run(peer: Any, kit: Any, ids: list[int], **kw: Any) -> list[Any]:
    return list(peer.create_generator(kit, ids, request_id=str(uuid.uuid4()), **kw))


def _fresh_run(peer: Any, path: Path, ids: list[int], draft: bool = False, **kw: Any) -> list[Any]:
    """One request on a newly loaded sequential kit: the peer's cross-prompt cache (with
    a draft model, its draft cache too) changes what the next request on a kit does."""
    kit = _kit(peer, path, batched=False)
    try:
        if draft:
            peer.load_draft_model(kit, path)
        return _run(peer, kit, ids, **kw)
    finally:
        kit.shutdown()


def _outcome(results: list[Any]) -> tuple[str, list[int], Any, list[Any]]:
    """What a caller of `create_generator` gets: text, token ids, how it stopped, and
    each token's from_draft."""
    tokens = [t for r in results for t in r.tokens]
    stops = [r.stop_condition for r in results if r.stop_condition is not None]
    return (
        "".join(r.text for r in results),
        [t.id for t in tokens],
        stops[-1] if stops else None,
        [t.from_draft for t in tokens],
    )


def lmstudio_results(peer: Any, tokenizer: Any, responses: Iterator[Any]) -> Iterator[Any]:
    """The recipe: tokentrail responses (`whole_tokens=True`) as mlx-engine's
    `GenerationResult`s, one per response with text or a finish, by field mapping."""
    from mlx_engine.utils.generation_result import GenerationResult, GenerationStopCondition
    from mlx_engine.utils.token import Token

    for r in responses:
        if not (r.text or r.finish_reason):
            continue
        spans = r.last_segment_tokens + r.stop_tokens
        stop = None
        if r.stop_string is not None:
            stop = GenerationStopCondition(
                "stop_string", r.stop_string, [t.id for t in r.stop_tokens]
            )
        elif r.finish_reason == "stop":
            stop = GenerationStopCondition("eos_token", tokenizer.decode(r.token), [r.token])
        yield GenerationResult(
            text=r.text,
            tokens=[Token(t.id, tokenizer.decode(t.id), t.logprob, t.from_draft) for t in spans],
            top_logprobs=[
                [Token(a.id, tokenizer.decode(a.id), a.logprob) for a in t.top_logprobs or ()]
                for t in spans
                if t.top_logprobs
            ],
            stop_condition=stop,
        )


def _cases(tokenizer: Any) -> list[tuple[str, list[int], dict[str, Any]]]:
    text = tokenizer.encode("The for statement")
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True
    )
    return [
        ("length", text, {"max_tokens": 24, "temp": 0.0}),
        (
            "stop strings",
            text,
            {"max_tokens": 48, "temp": 0.0, "stop_strings": ["__", "\n\n", ". "]},
        ),
        (
            "top logprobs",
            chat,
            {"max_tokens": 24, "temp": 0.0, "top_logprobs": 3, "repetition_penalty": 1.2},
        ),
        ("json schema", chat, {"max_tokens": 24, "temp": 0.0, "json_schema": JSON_SCHEMA}),
    ]


def _check_once(responses: list[Any]) -> None:
    """Every token in exactly one response's spans (the last one's stop tokens too)."""
    listed = [t for r in responses for t in r.last_segment_tokens]
    listed += responses[-1].stop_tokens
    assert [t.index for t in listed] == list(range(len(responses)))
    assert [t.id for t in listed] == [r.token for r in responses]
    assert [t.from_draft for t in listed] == [r.from_draft for r in responses]


def test_sequential_swap_gives_mlx_engine_results(
    peer: Any, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tokentrail

    tokenizer = _tokenizer(model_path)
    for name, ids, kw in _cases(tokenizer):
        plain = _fresh_run(peer, model_path, ids, **kw)
        theirs = _outcome(plain)
        seen: list[Any] = []
        mapped: list[Any] = []

        def swapped(
            *args: Any,
            _seen: list[Any] = seen,
            _mapped: list[Any] = mapped,
            _kw: dict[str, Any] = kw,
            **kwargs: Any,
        ) -> Iterator[Any]:
            stream = tokentrail.stream_generate(
                *args,
                align_to_prompt=False,
                skip_special_tokens=False,
                whole_tokens=True,
                stop=_kw.get("stop_strings"),
                top_logprobs=_kw.get("top_logprobs", 0),
                **kwargs,
            )
            for r in stream:
                _seen.append(r)
                _mapped.extend(lmstudio_results(peer, tokenizer, iter([r])))
                yield r

        with monkeypatch.context() as mp:
            mp.setattr(peer, "stream_generate", swapped)
            ours = _outcome(_fresh_run(peer, model_path, ids, **kw))
        assert ours == theirs, name  # the one-line swap changes nothing
        _check_once(seen)
        # the peer's loop as a field mapping: the same text, ids and stop; its
        # stop_tokens reach back over tokens that only began a partial match
        # ("\n" of "\n\n" before '"__'), tokentrail's are those that carried it
        text, ids_, stop, _ = _outcome(mapped)
        assert (text, ids_) == theirs[:2], name
        if theirs[2] is None or stop is None:
            assert stop == theirs[2], name
        else:
            assert stop[:2] == theirs[2][:2], name
            n = len(stop.stop_tokens)
            assert n and stop.stop_tokens == theirs[2].stop_tokens[-n:], name
        if kw.get("top_logprobs"):  # the peer's own top-k, from the same logprobs
            want = [top for r in plain for top in r.top_logprobs]
            got = [top for r in mapped for top in r.top_logprobs]
            assert [[t.id for t in top] for top in got] == [[t.id for t in top] for top in want]
            for a, b in zip(got, want, strict=True):
                assert [t.logprob for t in a] == pytest.approx([t.logprob for t in b], abs=1e-4)


def test_sequential_swap_with_a_draft_model(
    peer: Any, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative decoding (the model as its own draft): from_draft per token is the
    peer's, on its tokens and on tokentrail's spans."""
    import tokentrail

    ids = _tokenizer(model_path).encode("The for statement")
    kw = {"max_tokens": 32, "temp": 0.0, "num_draft_tokens": 3}
    theirs = _outcome(_fresh_run(peer, model_path, ids, draft=True, **kw))
    seen: list[Any] = []

    def swapped(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for r in tokentrail.stream_generate(
            *args,
            align_to_prompt=False,
            skip_special_tokens=False,
            whole_tokens=True,
            **kwargs,
        ):
            seen.append(r)
            yield r

    monkeypatch.setattr(peer, "stream_generate", swapped)
    ours = _outcome(_fresh_run(peer, model_path, ids, draft=True, **kw))
    assert ours == theirs
    assert any(theirs[3]), "the draft model proposed no accepted token"
    _check_once(seen)


def test_batched_kit_with_the_drop_in(
    peer: Any, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`install(kit)` reaches the detokenizer the batched kit copies per request; fed
    `add_token(token, logprob, top)`, each read lists every token once with its logprob."""
    import tokentrail.detokenizer

    plain = _kit(peer, model_path, batched=True)
    try:
        cases = _cases(plain.tokenizer)
        theirs = {}
        for name, ids, kw in cases:
            if "json_schema" in kw:
                continue
            theirs[name] = _run(peer, plain, ids, **kw)
    finally:
        plain.shutdown()
    from mlx_engine.model_kit.batched_vision import BatchedVisionModelKit

    reads: list[Any] = []
    emit = BatchedVisionModelKit._emit_response

    def emit_with_tokens(self: Any, result: Any, response: Any) -> Any:
        # LM Studio's side of the recipe: feed the logprob and top-k with each token,
        # and read the tokens behind each text (the kit binds this method at start)
        det = result.detokenizer
        det.add_token = functools.partial(
            type(det).add_token,
            det,
            logprob=response.token_logprob,
            top_logprobs=response.top_logprobs,
        )
        out = emit(self, result, response)
        reads.append((result.request_id, response, list(det.last_segment_tokens)))
        return out

    monkeypatch.setattr(BatchedVisionModelKit, "_emit_response", emit_with_tokens)
    kit = _kit(peer, model_path, batched=True)
    try:
        template = tokentrail.detokenizer.install(kit, like_mlx_lm=True, whole_tokens=True)
        assert kit.detokenizer is template
        for name, ids, kw in cases:
            if "json_schema" in kw:
                continue  # METAL_ONLY: see test_batched_json_schema
            rid = str(uuid.uuid4())
            ours = list(peer.create_generator(kit, ids, request_id=rid, **kw))
            assert _outcome(ours)[:3] == _outcome(theirs[name])[:3], name
            mine = [(resp, spans) for r, resp, spans in reads if r == rid]
            fed = [resp for resp, _ in mine if resp.finish_reason != "stop"]
            listed = [t for _, spans in mine for t in spans]
            indices = [t.index for t in listed]
            assert len(indices) == len(set(indices)), (name, "a token listed twice")
            if mine[-1][0].finish_reason is not None:  # finalized: every token listed
                assert indices == list(range(len(fed))), name
            assert [t.id for t in listed] == [int(r.token) for r in fed][: len(listed)]
            for t in listed:
                assert t.logprob == pytest.approx(float(fed[t.index].token_logprob))
    finally:
        kit.shutdown()


def test_batched_json_schema(peer: Any) -> None:
    pytest.skip(METAL_ONLY)
