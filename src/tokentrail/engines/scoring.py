"""Continuation scorers for the in-process engines: the model's own logprob of a
candidate continuation, from its full distribution (no sampling processors, no mask).

`tokentrail.structure.ContinuationScorer` is what JSON fields need for `alternatives`:
`continuation_logprobs(k, ids)` is the logprob of each of `ids`, teacher-forced after
the prompt and the output's first `k` tokens. Here that is one forward pass of the model
over prompt + output[:k] + ids (no cache is touched, so generation is unaffected; on
llama.cpp the pass takes the engine's own context, which a server's batch does not use,
and the engine's own generation decodes its sequence again after it); it runs only for
a leaf with allowed values, and only when fields were asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ModelScorer", "position_logprobs", "scorer_for"]

from .base import Row


class ModelScorer:
    """A `ContinuationScorer` over `logprobs(ids, n)`: the model's logprob (log_softmax
    of its logits) of each of `ids[n:]` at its position in `ids`; `output_ids` is the
    output so far (a live list the caller appends to)."""

    def __init__(
        self,
        logprobs: Callable[[list[int], int], list[float]],
        tokenizer: Any,
        prompt_ids: Sequence[int],
        output_ids: list[int],
    ) -> None:
        self._logprobs = logprobs
        self._tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)
        self.output_ids = output_ids

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def continuation_logprobs(self, prefix_index: int, token_ids: Sequence[int]) -> list[float]:
        if prefix_index > len(self.output_ids):
            raise ValueError(
                f"prefix_index {prefix_index} is past the {len(self.output_ids)} tokens output"
            )
        head = self.prompt_ids + self.output_ids[:prefix_index]
        if not head:
            raise ValueError("nothing before the continuation: the model has no position to score")
        ids = list(token_ids)
        if not ids:
            return []
        return [float(x) for x in self._logprobs(head + ids, len(head))]


def _mlx_logprobs(model: Any) -> Callable[[list[int], int], list[float]]:
    import mlx.core as mx

    def logprobs(ids: list[int], n: int) -> list[float]:
        logits = model(mx.array(ids)[None])[0, n - 1 : -1].astype(mx.float32)
        rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(rows, mx.array(ids[n:])[:, None], axis=-1)
        return picked[:, 0].tolist()

    return logprobs


def _torch_logprobs(model: Any, device: Any) -> Callable[[list[int], int], list[float]]:
    import torch

    def logprobs(ids: list[int], n: int) -> list[float]:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, n - 1 : -1]
            rows = torch.log_softmax(logits.float(), dim=-1)
            want = torch.tensor(ids[n:], device=rows.device)[:, None]
            return rows.gather(-1, want)[:, 0].cpu().tolist()

    return logprobs


def _llamacpp_logprobs(engine: Any) -> Callable[[list[int], int], list[float]]:
    """On the engine's own context (`llamacpp.positions`): a server's batch decodes on
    its own, and the engine's own generation decodes its sequence again after it."""
    from .llamacpp.positions import position_rows

    def logprobs(ids: list[int], n: int) -> list[float]:
        return [lp for lp, _ in position_rows(engine, ids, n, 0)]

    return logprobs


def scorer_for(
    engine: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    output_ids: list[int],
    options: dict[str, Any] | None = None,
) -> tuple[ModelScorer | None, str | None]:
    """A scorer for `engine` (MLX, torch or llama.cpp), or (None, why not)."""
    options = options or {}
    if options.get("prompt_cache") is not None or options.get("input_embeddings") is not None:
        return None, "a prompt cache or input embeddings hide the prompt's tokens from the scorer"
    if not prompt_ids:
        return None, "an empty prompt leaves the first token nothing to be scored after"
    model = getattr(engine, "model", None)
    if engine.name == "mlx" and model is not None:
        return ModelScorer(_mlx_logprobs(model), tokenizer, prompt_ids, output_ids), None
    if engine.name == "torch" and model is not None:
        device = getattr(engine, "device", None)
        fn = _torch_logprobs(model, device)
        return ModelScorer(fn, tokenizer, prompt_ids, output_ids), None
    if engine.name == "llamacpp" and getattr(engine, "llama", None) is not None:
        fn = _llamacpp_logprobs(engine)
        return ModelScorer(fn, tokenizer, prompt_ids, output_ids), None
    return None, f"the {engine.name} engine does not score continuations (no logits in process)"


def _mlx_rows(model: Any, ids: list[int], n: int, k: int) -> list[Row]:
    import mlx.core as mx

    logits = model(mx.array(ids)[None])[0, n - 1 : -1].astype(mx.float32)
    rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(rows, mx.array(ids[n:])[:, None], axis=-1)[:, 0].tolist()
    if k <= 0:
        return [(lp, []) for lp in picked]
    order = mx.argsort(-rows, axis=-1)[:, :k]
    values = mx.take_along_axis(rows, order, axis=-1)
    return [
        (lp, list(zip(o, v, strict=True)))
        for lp, o, v in zip(picked, order.tolist(), values.tolist(), strict=True)
    ]


def _torch_rows(model: Any, device: Any, ids: list[int], n: int, k: int) -> list[Row]:
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, n - 1 : -1]
        rows = torch.log_softmax(logits.float(), dim=-1)
        want = torch.tensor(ids[n:], device=rows.device)[:, None]
        picked = rows.gather(-1, want)[:, 0].cpu().tolist()
        if k <= 0:
            return [(lp, []) for lp in picked]
        values, order = rows.topk(k, dim=-1)
        return [
            (lp, list(zip(o, v, strict=True)))
            for lp, o, v in zip(picked, order.cpu().tolist(), values.cpu().tolist(), strict=True)
        ]


def position_logprobs(
    engine: Any, ids: list[int], n: int, k: int
) -> tuple[list[Row] | None, str | None]:
    """For each of `ids[n:]`, teacher-forced after `ids[:n]` in one forward pass: the
    model's logprob of it (log_softmax of its logits, no sampling processors) and the
    `k` most likely (id, logprob), most likely first. (None, why not) for an engine with
    no logits in process (MLX, torch and llama.cpp have them; llama.cpp's come from its
    engine's own context, `llamacpp.positions`; vLLM computes them itself as its
    ``prompt_logprobs``, `vllm.positions`)."""
    if n < 1 or n > len(ids):
        raise ValueError(f"n must be in 1..{len(ids)}, got {n}")
    if n == len(ids):
        return [], None
    model = getattr(engine, "model", None)
    if engine.name == "mlx" and model is not None:
        return _mlx_rows(model, ids, n, k), None
    if engine.name == "torch" and model is not None:
        return _torch_rows(model, getattr(engine, "device", None), ids, n, k), None
    if engine.name == "llamacpp" and getattr(engine, "llama", None) is not None:
        from .llamacpp.positions import position_rows

        return position_rows(engine, ids, n, k), None
    if engine.name == "vllm":
        from .vllm.positions import position_rows as vllm_rows

        rows = vllm_rows(engine, ids, n, k)
        if rows is not None:
            return rows, None
        return None, "an offline vllm.LLM streams one request at a time"
    return None, f"the {engine.name} engine does not expose its logits in process"
