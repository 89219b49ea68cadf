"""llama.cpp's parallel sequences as a tokentrail `Batch` (see `engines/batch.py`).

One llama.cpp context with `n_seq_max` sequences over one KV cache (unified: shared by the
sequences, each may use all of it; or split, llama.cpp's `kv_unified` off: a cache of
n_ctx / n_seq_max cells per sequence, see `LlamaCppBatch`): every `step`
builds one `llama_batch` holding the next token of each generating sequence and chunks of
the prompts still being read (generating sequences first, prompts filling the rest of the
`n_batch` budget), runs one `llama_decode`, then samples each sequence that produced
logits with its own llama.cpp sampler chain at its row (`llama_sampler_sample(chain, ctx,
i)`) and reads its logprob and top-k from that row, as the single-sequence engine does.

Prompt cache, in host memory, as llama-server's `--cache-ram` with its idle slots cleared
(its default): a finished or removed sequence's KV state is copied out
(`llama_state_seq_get_data`) with the tokens it holds, and its cells leave the KV cache
at the next step. Idle cells left in a unified KV cache would cost every later step:
llama.cpp's attention spans the cache up to its highest used cell, masked per sequence,
so a lone sequence after a busy spell would attend over every idle sequence's cells.
A new sequence takes the free sequence whose cells (not cleared yet) share the longest
prefix with its prompt, or, where a saved state shares more, gets that state back
(`llama_state_seq_set_data`); the cells past the shared prefix are dropped
(`llama_memory_seq_rm(mem, seq, keep, -1)`) and only the rest is evaluated;
`cached_tokens(uid)` reports the reused prefix. Saved states are kept least recently
used first within `prompt_cache_bytes` (default 8 GiB, llama-server's `--cache-ram 8192`);
a state another one extends is dropped for it.

`prompt_cache_bytes=0` keeps llama-server's `--cache-ram 0` behaviour instead: idle
sequences keep their cells in the KV cache, a new sequence takes the free one sharing
the longest prefix with its prompt (else the least recently used one), and the idle
cells are freed when the shared KV cache has no room for a step.
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import numpy as np

from ...sampling import SamplingParams
from ..base import Step, check_generate_args
from ..batch import BaseBatch, check_prompt_cache_bytes
from ..saved_prompts import PromptStore, SavedPrompt
from .guided import guided_chain, guided_step
from .sampling import REPEAT_LAST_N, LazyLogprobs, make_sampler, step_logprobs

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PROMPT_CACHE_BYTES", "DEFAULT_SLOTS", "LlamaCppBatch", "LlamaSlot", "slots"]


#: Parallel sequences when the model was loaded with one slot (llama-server's default).
DEFAULT_SLOTS = 4
#: How many finished sequences' `cached_tokens` stay readable after they leave.
_CACHED_KEPT = 256
#: The host-memory prompt cache's default bound: llama-server's `--cache-ram 8192` (MiB).
DEFAULT_PROMPT_CACHE_BYTES = 8192 << 20


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _pointer(data: np.ndarray) -> Any:
    """`data`'s buffer as the `uint8_t *` llama.cpp's state functions take."""
    return data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


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
    cached: int = 0  # prompt tokens whose KV cells were reused from the prompt cache
    tokens: list[int] = field(default_factory=list)  # what its KV cells hold, in order


class LlamaCppBatch(BaseBatch):
    """Sequences decoded together by one llama.cpp context; see `Batch`.

    `n_ctx` is the KV cache of all sequences (default: the engine's context length).
    `max_batch` None: `slots(engine)` sequences.

    `kv_unified` is its layout (None: the engine's `kv_unified`, which `load` sets; True
    where it says nothing). Unified, the cache is shared: a sequence's prompt plus its
    tokens must fit in it next to the others'. Split (False), each sequence has its own
    `context_length` = n_ctx / max_batch cells and attends over those alone, so its
    tokens and logprobs do not depend on the others' (a unified cache's do, in llama.cpp;
    docs/engines.md). "auto" is llama-server's rule for ``-kvu``: unified when the slot
    count is left to it (`max_batch` None), split when it is given.
    """

    #: `step` spends its time in one `llama_decode` call, which ctypes runs without the
    #: GIL: the server's scheduler hands events over from another thread meanwhile.
    compute_releases_gil = True

    def __init__(
        self,
        engine: Any,
        max_batch: int | None = None,
        *,
        n_ctx: int | None = None,
        prompt_cache_bytes: int | None = None,
        kv_unified: bool | str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(slots(engine) if max_batch is None else max_batch)
        layout = getattr(engine, "kv_unified", True) if kv_unified is None else kv_unified
        if layout not in (True, False, "auto"):
            raise ValueError(f"kv_unified must be True, False or 'auto', got {layout!r}")
        #: The KV cache's layout: shared by the sequences (True) or split among them.
        self.kv_unified = max_batch is None if layout == "auto" else bool(layout)
        check_prompt_cache_bytes(prompt_cache_bytes)
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
        params.kv_unified = self.kv_unified
        params.flash_attn_type = getattr(engine, "flash_attn_type", base.flash_attn_type)
        self.n_batch = int(params.n_batch)
        self._ctx = LlamaContext(model=engine.llama._model, params=params, verbose=False)
        self.n_ctx = int(llama_cpp.llama_n_ctx(self._ctx.ctx))  # as llama.cpp rounded it
        #: The most tokens one sequence may hold: all of `n_ctx` unified, its share split.
        self.context_length = int(llama_cpp.llama_n_ctx_seq(self._ctx.ctx))
        self._batch = LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1, verbose=False)
        self._mem = llama_cpp.llama_get_memory(self._ctx.ctx)
        self._free = list(range(self.max_batch))  # least recently used first
        self._held: list[list[int]] = [[] for _ in range(self.max_batch)]  # free seqs' cells
        #: Bound of the host-memory prompt cache in bytes (0: idle cells stay in the KV cache).
        self.prompt_cache_bytes = (
            DEFAULT_PROMPT_CACHE_BYTES if prompt_cache_bytes is None else prompt_cache_bytes
        )
        self._saved = PromptStore(self.prompt_cache_bytes)
        self._cached: dict[int, int] = {}  # uid -> prompt tokens reused (recent uids)
        self._live: dict[int, LlamaSlot] = {}
        self.decodes = 0  # bumped at every decode: which logits the buffer holds
        self._scratch = np.empty(engine.vocab_size or 0, dtype=np.float32)

    def _context_words(self) -> str:
        """The per-sequence context in words, for errors."""
        if self.kv_unified:
            return f"{self.n_ctx} tokens"
        return (
            f"{self.context_length} tokens per sequence (its KV cache of {self.n_ctx} split "
            f"among {self.max_batch} sequences; a shared cache lets one sequence use all "
            "of it: kv_unified=True, serve --kv-unified on)"
        )

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None) -> int:
        ids = check_generate_args(prompt_ids, params, max_tokens, self.engine.vocab_size)
        if not self._free:
            raise RuntimeError(f"the batch is full ({self.max_batch} sequences)")
        if len(ids) >= self.context_length:
            raise ValueError(
                f"prompt is {len(ids)} tokens, which leaves no room in the batch's context "
                f"of {self._context_words()}"
            )
        uid = next(self._uids)
        params = self.engine.bound(params)
        guided = guided_chain(params, self.engine.vocab_size or 0)
        chain = make_sampler(params, ids, self.engine.vocab_size or 0, guided)
        window = deque(ids[-REPEAT_LAST_N:], maxlen=REPEAT_LAST_N)
        if self.prompt_cache_bytes and not any(s.n_past for s in self._live.values()):
            # Nothing else holds cells: the idle ones (saved) leave first, so what comes
            # back from host memory lies in order from the cache's first cell and the
            # sequence decodes what it decodes cold (`_evict`).
            self._evict()
        seq_id, keep = self._claim(ids)
        self._live[uid] = LlamaSlot(
            seq_id,
            params,
            max_tokens,
            chain,
            ids[keep:],
            window,
            n_past=keep,
            guided=guided,
            cached=keep,
            tokens=ids[:keep],
        )
        self._cached[uid] = keep
        if len(self._cached) > _CACHED_KEPT:
            del self._cached[next(iter(self._cached))]
        return uid

    def _claim(self, ids: list[int]) -> tuple[int, int]:
        """A free sequence for prompt `ids` and how many of its tokens its KV cells
        already hold: the free sequence whose cells share the longest prefix with `ids`,
        or, when a state saved in host memory shares more, an empty one (else the least
        recently used, cleared) with that state restored into it; else an empty one (the
        least recently used; split, the lowest id), else the least recently used. Its
        cells past that prefix are dropped; at least the
        prompt's last token is left to evaluate (its logits are needed)."""
        lengths = [common_prefix(self._held[s], ids) for s in self._free]
        best = max(range(len(lengths)), key=lambda j: (lengths[j], -j))
        saved, saved_length = self._saved.longest(ids)
        if lengths[best] == 0 or saved_length > lengths[best]:
            empty = [j for j, s in enumerate(self._free) if not self._held[s]] or [0]
            # split: the lowest id, so the live ids run without gaps (`_fill`)
            best = empty[0] if self.kv_unified else min(empty, key=self._free.__getitem__)
        seq_id = self._free.pop(best)
        held, self._held[seq_id] = self._held[seq_id], []
        if saved is not None and saved_length > common_prefix(held, ids):
            if held:
                llama_cpp.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
            return seq_id, self._restore(seq_id, saved, saved_length, ids)
        return seq_id, self._trim(seq_id, held, ids)

    def _trim(self, seq_id: int, held: list[int], ids: list[int]) -> int:
        """Drop sequence `seq_id`'s cells past the prefix that `held` (what they hold)
        shares with `ids`; return how many stay (0: the sequence is empty)."""
        keep = min(common_prefix(held, ids), len(ids) - 1)
        rm = llama_cpp.llama_memory_seq_rm
        if keep < len(held) and not (keep > 0 and rm(self._mem, seq_id, keep, -1)):
            keep = 0
        if keep == 0 or llama_cpp.llama_memory_seq_pos_min(self._mem, seq_id) != 0:
            rm(self._mem, seq_id, -1, -1)  # nothing to reuse, or cells already pruned (SWA)
            keep = 0
        return keep

    def _restore(self, seq_id: int, saved: SavedPrompt, shared: int, ids: list[int]) -> int:
        """Restore `saved` into empty sequence `seq_id`, trimmed to the `shared` tokens it
        has in common with `ids`; return how many prompt tokens it gives (0: none, or no
        room in the KV cache for its cells)."""
        if min(shared, len(ids) - 1) == 0:
            return 0
        got = llama_cpp.llama_state_seq_set_data(
            self._ctx.ctx, _pointer(saved.data), saved.size, seq_id
        )
        if got != saved.size:  # no room for its cells: evaluate the whole prompt
            llama_cpp.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
            return 0
        self._saved.touch(saved)
        return self._trim(seq_id, saved.tokens, ids)

    def _save(self, seq_id: int, tokens: list[int]) -> None:
        """Copy sequence `seq_id`'s KV state (holding `tokens`) into host memory, unless a
        saved state already starts with `tokens` (`PromptStore.put` keeps the store
        prefix-free and within its bound)."""
        if self._saved.covers(tokens):
            return
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx.ctx, seq_id))
        if size > self._saved.limit:  # never kept: not worth the copy
            return
        data = np.empty(size, dtype=np.uint8)  # no zero fill: llama.cpp writes every byte
        if llama_cpp.llama_state_seq_get_data(self._ctx.ctx, _pointer(data), size, seq_id) == size:
            self._saved.put(SavedPrompt(list(tokens), data))

    @property
    def saved_bytes(self) -> int:
        """Bytes of KV state the host-memory prompt cache holds."""
        return self._saved.nbytes

    def kv_positions(self) -> list[int]:
        """Each llama.cpp sequence's highest position in the KV cache (-1: no cells)."""
        pos_max = llama_cpp.llama_memory_seq_pos_max
        return [int(pos_max(self._mem, s)) for s in range(self.max_batch)]

    def cached_tokens(self, uid: int) -> int:
        """How many of sequence `uid`'s prompt tokens came from the prompt cache."""
        return self._cached.get(uid, 0)

    def remove(self, uid: int) -> None:
        seq = self._live.pop(uid, None)
        if seq is None:
            return
        if seq.tokens and len(seq.tokens) == seq.n_past:  # its cells hold exactly these
            if self.prompt_cache_bytes:
                self._save(seq.seq_id, seq.tokens)
            self._held[seq.seq_id] = seq.tokens  # until the next step (or for good: no host cache)
        else:
            llama_cpp.llama_memory_seq_rm(self._mem, seq.seq_id, -1, -1)
        seq.chain.close()
        self._free.append(seq.seq_id)

    def _evict(self) -> bool:
        """Free the idle sequences' cached cells; whether there were any.

        In a unified cache llama.cpp then places the next tokens from the lowest free
        cell on, so a sequence decoding beside the freed cells may get its next tokens
        before its earlier ones, and its logits depend on where its cells lie (on
        SmolLM2 Q4_1 a logprob moved by 0.09 four tokens on, and the next request of a
        client alone got another reply, `tests/test_llamacpp_prompt_cache.py`): one more
        way a unified cache's
        sequences depend on each other (docs/engines.md). `add` evicts before it
        places a prompt into an otherwise empty batch, so requests one after another
        each decode what they decode cold."""
        idle = [s for s in self._free if self._held[s]]
        for s in idle:
            llama_cpp.llama_memory_seq_rm(self._mem, s, -1, -1)
            self._held[s] = []
        return bool(idle)

    def close(self) -> None:
        super().close()
        self._saved.clear()
        self._ctx.close()

    def _fill(self) -> list[tuple[int, LlamaSlot]]:
        """Put this step's tokens into the llama_batch; return the sequences in it.

        Which tokens: generating sequences' first, prompts filling the rest of `n_batch`.
        In the batch they are in sequence id order where the cache is split: llama.cpp
        cuts such a batch into ubatches of consecutive sequence ids, as they come
        (`llama_batch_allocr::split_equal`, sequential), each one a pass over the
        weights, so ids out of order would cost a pass each."""
        plan: list[tuple[int, LlamaSlot, list[int]]] = []
        n = 0
        order = sorted(self._live.items(), key=lambda kv: len(kv[1].pending) > 1)
        for uid, seq in order:  # generating sequences (1 pending token) first
            seq.row = -1
            room = self.n_batch - n
            if room <= 0 or not seq.pending:
                continue
            take = seq.pending[:room]
            n += len(take)
            plan.append((uid, seq, take))
        if not self.kv_unified:
            plan.sort(key=lambda p: p[1].seq_id)
        b = self._batch.batch
        n = 0
        used: list[tuple[int, LlamaSlot]] = []
        for uid, seq, take in plan:
            for j, tok in enumerate(take):
                b.token[n] = tok
                b.pos[n] = seq.n_past + j
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = seq.seq_id
                b.logits[n] = False
                n += 1
            del seq.pending[: len(take)]
            seq.n_past += len(take)
            seq.tokens += take
            if not seq.pending:  # its last prompt token (or its new token): sample here
                b.logits[n - 1] = True
                seq.row = n - 1
            used.append((uid, seq))
        b.n_tokens = n
        return used

    def step(self) -> list[tuple[int, Step | Exception]]:
        """One llama_decode for every live sequence, then each one's sample; a sequence
        whose grammar or sampler fails is `(uid, the exception)` and has left the batch
        (the others go on)."""
        if not self._live:
            return []
        for uid, seq in list(self._live.items()):
            if seq.n_past + len(seq.pending) > self.context_length:
                raise RuntimeError(
                    f"sequence {uid} no longer fits the context of {self._context_words()}"
                )
        if self.prompt_cache_bytes:
            self._evict()  # idle cells take no part in a decode: their state is saved
        used = self._fill()
        if not used:
            return []
        rc = llama_cpp.llama_decode(self._ctx.ctx, self._batch.batch)
        if rc == 1 and self._evict():  # no room in the KV cache: not for idle caches
            rc = llama_cpp.llama_decode(self._ctx.ctx, self._batch.batch)
        if rc != 0:
            for seq in self._live.values():
                seq.tokens = []  # what its cells hold is unknown now: never reused
            raise RuntimeError(
                f"llama_decode returned {rc} (the shared KV cache of {self.n_ctx} tokens is "
                "full; open the batch with a larger n_ctx or fewer sequences)"
            )
        self.decodes += 1
        out: list[tuple[int, Step | Exception]] = []
        vocab = self.engine.vocab_size or 0
        for uid, seq in used:
            if seq.row < 0:
                continue
            try:
                out.append((uid, self._sample(seq, vocab)))
            except Exception as e:  # this sequence's grammar or sampler failed: it alone
                log.info("sequence %s left the batch: %s", uid, e)
                self.remove(uid)
                out.append((uid, e))
                continue
            if seq.max_tokens is not None and seq.produced >= seq.max_tokens:
                self.remove(uid)
        return out

    def _sample(self, seq: LlamaSlot, vocab: int) -> Step:
        """Sample one sequence's row of the decode just run; its Step."""
        if seq.guided is not None:
            seq.guided.prepare()
        token = int(llama_cpp.llama_sampler_sample(seq.chain.sampler, self._ctx.ctx, seq.row))
        ptr = llama_cpp.llama_get_logits_ith(self._ctx.ctx, seq.row)
        x = np.ctypeslib.as_array(ptr, shape=(vocab,))
        p = seq.params
        lp, top, lse, affected = step_logprobs(
            x,
            token,
            p.top_logprobs,
            p.logit_bias,
            seq.window,
            p.repetition_penalty,
            self._scratch,
            p.presence_penalty,
            p.frequency_penalty,
        )
        seq.window.append(token)
        seq.produced += 1
        seq.pending = [token]
        full = LazyLogprobs(self, x, lse, affected)
        return guided_step(seq.guided, token, lp, top, full, p)
