"""Engines with their tokenizer and an oracle for the model's own logprobs, for the
constrained-decoding tests (tests/test_constrain.py, tests/test_constrain_reasoning.py):
the demo model on MLX and torch, SmolLM2-135M-Instruct on llama.cpp."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tokentrail.engines.base import Step
from tokentrail.sampling import make_params

LIMIT = 64


def chat_ids(tok: Any, text: str) -> list[int]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
    )
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def eos_of(tok: Any) -> set[int]:
    ids = getattr(tok, "eos_token_ids", None)
    return set(ids) if ids else {tok.eos_token_id}


class Rig:
    """One engine with its tokenizer and an oracle for the model's own logprobs."""

    def __init__(
        self,
        engine: Any,
        tok: Any,
        oracle: Callable[[list[int], int], np.ndarray],
        fresh: Callable[[], None] | None = None,
    ):
        self.engine, self.tok, self.oracle = engine, tok, oracle
        self.eos = eos_of(tok)
        #: Called before each run: the engine then starts as the oracle does.
        self.fresh = fresh

    def run(self, ids: list[int], constraint: Any, limit: int = LIMIT, **kw: Any) -> list[Step]:
        """Steps until the first EOS (included), at most `limit`."""
        c = None if constraint is None else constraint.bind(self.tok)
        if self.fresh is not None:
            self.fresh()
        out = []
        for step in self.engine.generate(ids, make_params(constraint=c, **kw), limit):
            out.append(step)
            if step.token in self.eos:
                break
        return out

    def text(self, steps: list[Step]) -> str:
        assert steps[-1].token in self.eos, "the grammar did not end the stream"
        return self.tok.decode([s.token for s in steps[:-1]])


def mlx_rig() -> Rig:
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install -e '.[mlx]'")
    import mlx.core as mx

    import tokentrail
    from tokentrail.engines import engine_for

    model, tok = tokentrail.load()

    def oracle(ids: list[int], n_prompt: int) -> np.ndarray:
        logits = model(mx.array(ids)[None])[0, n_prompt - 1 :].astype(mx.float32)
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    return Rig(engine_for(model), tok, oracle)


def torch_rig() -> Rig:
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    import tokentrail
    from tokentrail.engines import engine_for

    model, tok = tokentrail.load(None, engine="torch")

    def oracle(ids: list[int], n_prompt: int) -> np.ndarray:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0, n_prompt - 1 :].float()
        return torch.log_softmax(logits, dim=-1).numpy()

    return Rig(engine_for(model), tok, oracle)


#: The engines a `rig` fixture runs on (its params).
ENGINES = ["mlx", "torch", "llamacpp"]


def open_rig(request: pytest.FixtureRequest) -> Rig:
    """The rig of `request.param` (one of `ENGINES`), for a module-scoped fixture."""
    if request.param == "mlx":
        return mlx_rig()
    if request.param == "torch":
        return torch_rig()
    engine, tok = request.getfixturevalue("smol")
    ref = request.getfixturevalue("smol_ref")

    def oracle(ids: list[int], n_prompt: int) -> np.ndarray:
        ref.reset()  # teacher-forced as the engine decodes: the prompt, then one at a time
        ref.eval(ids[:n_prompt])
        for t in ids[n_prompt:]:
            ref.eval([t])
        logits = np.asarray(ref.scores[n_prompt - 1 : len(ids)], dtype=np.float64)
        m = logits.max(axis=-1, keepdims=True)
        return logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))

    # llama.cpp's logits at a position depend on how it was evaluated: in the prompt's
    # batch, or alone after a reused prefix (its batch and single-token kernels differ;
    # 0.04 in a logprob on SmolLM2's Q4_1 with the portable x86-64 build). The engine
    # reuses what the previous run left in the KV cache, the oracle evaluates the prompt
    # as one batch: each run starts from an empty cache, as the oracle does.
    return Rig(engine, tok, oracle, fresh=engine.llama.reset)


def drain(batch: Any, eos: set[int]) -> dict[int, list[Step]]:
    got: dict[int, list[Step]] = {}
    done: set[int] = set()
    for _ in range(4 * LIMIT):
        if not len(batch):
            break
        for uid, step in batch.step():
            if uid in done:
                continue
            got.setdefault(uid, []).append(step)
            if step.token in eos:
                done.add(uid)
                batch.remove(uid)
    return got
