"""llama.cpp's parallel sequences as a tokentrail `Batch` (see `engines/batch.py`).

One llama.cpp context with `n_seq_max` sequences over a unified KV cache: every `step`
builds one `llama_batch` holding the next token of each generating sequence and chunks of
the prompts still being read (generating sequences first, prompts filling the rest of the
`n_batch` budget), runs one `llama_decode`, then samples each sequence that produced
logits with its own llama.cpp sampler chain at its row (`llama_sampler_sample(chain, ctx,
i)`) and reads its logprob and top-k from that row, as the single-sequence engine does.
A finished or removed sequence's KV cells are freed (`llama_memory_seq_rm`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from ..sampling import SamplingParams
from .base import Step, check_generate_args
from .batch import BaseBatch
from .llamacpp_guided import guided_chain, guided_step
from .llamacpp_sampling import REPEAT_LAST_N, LazyLogprobs, make_sampler, step_logprobs

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_SLOTS", "LlamaCppBatch", "LlamaSlot", "slots"]


#: Parallel sequences when the model was loaded with one slot (llama-server's default).
DEFAULT_SLOTS = 4


def slots(engine: Any) -> int:
    """The batch's capacity: the sequence slots the engine's model was loaded with
    (llama.cpp's `n_seq_max`) when more than one, else `DEFAULT_SLOTS`; at most
    llama.cpp's own limit."""
    loaded = int(getattr(engine.llama.context_params, "n_seq_max", 1) or 1)
    wanted = loaded if loaded > 1 else DEFAULT_SLOTS
    return max(1, min(wanted, int(llama_cpp.llama_max_parallel_sequences())))


@dataclass
class LlamaSlot:
    """One sequence of a `LlamaCppBatch`: its llama.cpp sequence id and sampler chain,
    what it still has to evaluate and where it is."""

    seq_id: int
    params: SamplingParams
    max_tokens: int | None
    chain: Any
    pending: list[int]  # tokens to evaluate next (the prompt, then the last sampled token)
    window: deque[int]
    n_past: int = 0
    produced: int = 0
    row: int = -1  # this step's logits row in the batch, -1 when none
    guided: Any = None  # a llamacpp_guided.GuidedChain (constraint, processed logprobs)


class LlamaCppBatch(BaseBatch):
    """Sequences decoded together by one llama.cpp context; see `Batch`.

    `n_ctx` is the KV cache shared by all sequences (default: the engine's context
    length); a sequence's prompt plus its tokens must fit in it next to the others'.
    `max_batch` None: `slots(engine)` sequences.
    """

    def __init__(self, engine: Any, max_batch: int | None = None, *,
                 n_ctx: int | None = None, **options: Any) -> None:
        super().__init__(slots(engine) if max_batch is None else max_batch)
        if options:
            log.debug("llama.cpp batch ignores options %s", sorted(options))
        # llama-cpp-python's wrappers of a second context on the same loaded weights and
        # of a llama_batch: its public `Llama` cannot open one, so they come from
        # `llama_cpp._internals` (and the weights from `Llama._model`).
        from llama_cpp._internals import LlamaBatch, LlamaContext

        self.engine = engine
        base = engine.llama.context_params
        params = type(base).from_buffer_copy(base)
        params.n_ctx = n_ctx or engine.context_length or 4096
        params.n_seq_max = self.max_batch
        params.kv_unified = True
        self.n_ctx = int(params.n_ctx)
        self.n_batch = int(params.n_batch)
        self._ctx = LlamaContext(model=engine.llama._model, params=params, verbose=False)
        self._batch = LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1, verbose=False)
        self._mem = llama_cpp.llama_get_memory(self._ctx.ctx)
        self._free = list(range(self.max_batch))
        self._live: dict[int, LlamaSlot] = {}
        self.decodes = 0  # bumped at every decode: which logits the buffer holds
        self._scratch = np.empty(engine.vocab_size or 0, dtype=np.float32)

    def add(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> int:
        ids = check_generate_args(prompt_ids, params, max_tokens, self.engine.vocab_size)
        if not self._free:
            raise RuntimeError(f"the batch is full ({self.max_batch} sequences)")
        if len(ids) >= self.n_ctx:
            raise ValueError(
                f"prompt is {len(ids)} tokens, which leaves no room in the batch's context "
                f"of {self.n_ctx} tokens"
            )
        uid = next(self._uids)
        params = self.engine.bound(params)
        guided = guided_chain(params, self.engine.vocab_size or 0)
        chain = make_sampler(params, ids, self.engine.vocab_size or 0, guided)
        window = deque(ids[-REPEAT_LAST_N:], maxlen=REPEAT_LAST_N)
        self._live[uid] = LlamaSlot(
            self._free.pop(0), params, max_tokens, chain, list(ids), window, guided=guided
        )
        return uid

    def remove(self, uid: int) -> None:
        seq = self._live.pop(uid, None)
        if seq is None:
            return
        llama_cpp.llama_memory_seq_rm(self._mem, seq.seq_id, -1, -1)
        seq.chain.close()
        self._free.append(seq.seq_id)

    def close(self) -> None:
        super().close()
        self._ctx.close()

    def _fill(self) -> list[tuple[int, LlamaSlot]]:
        """Put this step's tokens into the llama_batch; return the sequences in it."""
        b = self._batch.batch
        n = 0
        used: list[tuple[int, LlamaSlot]] = []
        order = sorted(self._live.items(), key=lambda kv: len(kv[1].pending) > 1)
        for uid, seq in order:  # generating sequences (1 pending token) first
            seq.row = -1
            room = self.n_batch - n
            if room <= 0 or not seq.pending:
                continue
            take = seq.pending[:room]
            for j, tok in enumerate(take):
                b.token[n] = tok
                b.pos[n] = seq.n_past + j
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = seq.seq_id
                b.logits[n] = False
                n += 1
            del seq.pending[: len(take)]
            seq.n_past += len(take)
            if not seq.pending:  # its last prompt token (or its new token): sample here
                b.logits[n - 1] = True
                seq.row = n - 1
            used.append((uid, seq))
        b.n_tokens = n
        return used

    def step(self) -> list[tuple[int, Step]]:
        if not self._live:
            return []
        for uid, seq in list(self._live.items()):
            if seq.n_past + len(seq.pending) > self.n_ctx:
                raise RuntimeError(f"sequence {uid} no longer fits the context of {self.n_ctx}")
        used = self._fill()
        if not used:
            return []
        rc = llama_cpp.llama_decode(self._ctx.ctx, self._batch.batch)
        if rc != 0:
            raise RuntimeError(
                f"llama_decode returned {rc} (the shared KV cache of {self.n_ctx} tokens is "
                "full; open the batch with a larger n_ctx or fewer sequences)"
            )
        self.decodes += 1
        out: list[tuple[int, Step]] = []
        vocab = self.engine.vocab_size or 0
        for uid, seq in used:
            if seq.row < 0:
                continue
            if seq.guided is not None:
                seq.guided.prepare()
            token = int(llama_cpp.llama_sampler_sample(seq.chain.sampler, self._ctx.ctx, seq.row))
            ptr = llama_cpp.llama_get_logits_ith(self._ctx.ctx, seq.row)
            x = np.ctypeslib.as_array(ptr, shape=(vocab,))
            p = seq.params
            lp, top, lse, affected = step_logprobs(
                x, token, p.top_logprobs, p.logit_bias, seq.window, p.repetition_penalty,
                self._scratch,
            )
            seq.window.append(token)
            seq.produced += 1
            seq.pending = [token]
            full = LazyLogprobs(self, x, lse, affected)
            out.append((uid, guided_step(seq.guided, token, lp, top, full, p)))
            if seq.max_tokens is not None and seq.produced >= seq.max_tokens:
                self.remove(uid)
        return out
