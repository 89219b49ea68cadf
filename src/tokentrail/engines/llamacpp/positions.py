"""Teacher-forced logprobs at every position of a token sequence on llama.cpp: what
``echo`` with ``logprobs`` lists for a prompt, and where a ``branch`` prefix is scored.

One pass over the ids on the engine's own context (the `Llama`'s; a server's batch
decodes on a context of its own), in batches of the context's ``n_batch`` tokens, each
position past the first `n - 1` asking llama.cpp for its logits. Each row is read as a
generation step's is (`sampling.step_logprobs`: the log-softmax of the raw logits, no
bias, penalty or filter) for the next id. The context's KV cache is emptied before and
after: the engine's next generation finds it used by someone else and decodes its own
sequence again (`LlamaCppEngine._eval`), and a step of it read before is marked stale
(`decodes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np

from ..base import Row
from .sampling import step_logprobs

__all__ = ["position_rows"]


def position_rows(engine: Any, ids: Sequence[int], n: int, k: int) -> list[Row]:
    """For each of `ids[n:]`, its logprob after the ids before it and the `k` most likely
    (id, logprob), most likely first. ValueError where the ids do not fit the engine's
    context or llama.cpp cannot decode them."""
    ids = [int(i) for i in ids]
    if not 1 <= n <= len(ids):
        raise ValueError(f"n must be in 1..{len(ids)}, got {n}")
    if n == len(ids):
        return []
    llama = engine.llama
    n_ctx = int(llama.n_ctx())
    if len(ids) - 1 > n_ctx:
        raise ValueError(
            f"{len(ids)} tokens do not fit the llama.cpp context of {n_ctx} tokens "
            "(load with a larger n_ctx)"
        )
    vocab = engine.vocab_size or 0
    if any(not 0 <= i < vocab for i in ids):
        raise ValueError(f"a token id is outside the vocabulary of {vocab} ids")
    ctx = llama.ctx
    n_batch = max(1, int(llama.n_batch))
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    scratch = np.empty(vocab, dtype=np.float32)
    rows: list[Row] = []
    last = len(ids) - 1  # the last id's own logits score nothing
    try:
        engine.forget_context()
        for start in range(0, last, n_batch):
            chunk = ids[start : min(start + n_batch, last)]
            b = batch  # (its fields are ctypes arrays, filled in place)
            for j, token in enumerate(chunk):
                b.token[j] = token
                b.pos[j] = start + j
                b.n_seq_id[j] = 1
                b.seq_id[j][0] = 0
                b.logits[j] = start + j >= n - 1
            b.n_tokens = len(chunk)
            rc = llama_cpp.llama_decode(ctx, b)
            engine.decodes += 1
            if rc != 0:
                raise ValueError(f"llama_decode returned {rc} while scoring {len(ids)} tokens")
            for j in range(max(0, n - 1 - start), len(chunk)):
                ptr = llama_cpp.llama_get_logits_ith(ctx, j)
                x = np.ctypeslib.as_array(ptr, shape=(vocab,))
                lp, top, _, _ = step_logprobs(x, ids[start + j + 1], k, None, (), None, scratch)
                rows.append((lp, top))
    finally:
        llama_cpp.llama_batch_free(batch)
        engine.forget_context()
    return rows

