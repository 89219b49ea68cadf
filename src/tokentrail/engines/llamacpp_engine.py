"""The llama.cpp engine: GGUF models through llama-cpp-python, llama.cpp's own sampler
chain, and logprobs read from a view over llama.cpp's logits buffer.

* Decoding uses the `llama_cpp.Llama` object's `eval` (llama.cpp's batches and KV cache,
  with the longest common prefix of the previous sequence reused, as `Llama.generate`).
* Sampling is a llama.cpp sampler chain (`llama_sampler_*`) in llama-cpp-python's order:
  logit bias, repeat penalty, top-k, top-p, min-p, temperature, then a seeded `dist`
  sampler (or `greedy` at temperature 0). The same seed and settings draw the same
  tokens as `Llama.create_completion` (without a repeat penalty; with one, the prompt
  also counts, as in llama-server).
* Each step's logprob and top-k come from `llama_get_logits_ith` read through a numpy
  view (no copy): one pass for the log-normalizer, a blockwise max to find the top-k,
  and exact corrections for the few ids that logit bias or the repeat penalty changed.
  `Step.logprobs` is a lazy view of the full vector, materialised only if asked for.
* The tokenizer (`LlamaCppTokenizer`) is llama.cpp's own: its `Vocab` is built from
  `llama_token_to_piece` for every id and the token attributes (control tokens are
  special), so the streamed text is byte for byte what llama.cpp streams.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from ..sampling import SamplingParams
from ..vocab import Vocab
from .base import Step, check_generate_args
from .gguf_models import GGUFError, check_magic, explain_llamacpp_failure, gguf_source

log = logging.getLogger(__name__)

#: How many recent tokens the repeat penalty looks at (llama.cpp's `penalty_last_n`).
REPETITION_CONTEXT_SIZE = 64
#: Default context when the model's own is larger (its KV cache is allocated up front).
DEFAULT_N_CTX = 4096
#: Block size of the blockwise top-k search over the logits.
_TOPK_BLOCK = 256
_DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed

__all__ = ["LlamaCppEngine", "LlamaCppTokenizer", "accepts", "load", "wrap"]


def load(
    path: str | os.PathLike[str],
    *,
    n_ctx: int | None = None,
    n_threads: int | None = None,
    n_gpu_layers: int = 0,
    n_batch: int = 512,
) -> tuple[LlamaCppEngine, LlamaCppTokenizer]:
    """Load a `.gguf` model file (or a named model such as ``smollm2``) with llama.cpp.

    `n_ctx` defaults to the model's training context, at most 4096 tokens; `n_threads`
    to llama-cpp-python's default; `n_gpu_layers` offloads layers where llama.cpp was
    built with a GPU backend. Returns (engine, tokenizer) for `stream_generate`.
    """
    p = gguf_source(path)
    if p is None:
        p = Path(path).expanduser()
        if p.is_dir():
            raise GGUFError(
                f"{p} is a folder; the llamacpp engine runs a .gguf model file (use "
                "--engine torch or mlx for a Hugging Face folder)"
            )
    check_magic(p)
    kwargs: dict[str, Any] = {"n_gpu_layers": n_gpu_layers, "n_batch": n_batch}
    if n_threads is not None:
        kwargs["n_threads"] = n_threads
    try:
        llama = llama_cpp.Llama(
            model_path=str(p), n_ctx=n_ctx or 0, verbose=False, logits_all=False, **kwargs
        )
    except ValueError as e:
        raise explain_llamacpp_failure(p, e) from e
    if not n_ctx and llama.n_ctx() > DEFAULT_N_CTX:
        del llama
        llama = llama_cpp.Llama(
            model_path=str(p), n_ctx=DEFAULT_N_CTX, verbose=False, logits_all=False, **kwargs
        )
    engine = LlamaCppEngine(llama)
    return engine, engine.tokenizer


def accepts(model: Any) -> bool:
    """Whether `model` is a llama-cpp-python `Llama` (or already this engine)."""
    return isinstance(model, llama_cpp.Llama | LlamaCppEngine)


def wrap(model: Any) -> LlamaCppEngine:
    return model if isinstance(model, LlamaCppEngine) else LlamaCppEngine(model)


# -- the tokenizer ------------------------------------------------------------------------


def _piece(vocab: Any, token: int, special: bool, buf: Any) -> bytes:
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:
        bigger = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, bigger, -n, 0, special)
        return bigger.raw[:n]
    return buf.raw[:n]


class LlamaCppTokenizer:
    """llama.cpp's tokenizer, with the interface `stream_generate` and the server use.

    `encode` is `llama_tokenize` (special tokens in the text are parsed, as llama-server
    does for prompts); `apply_chat_template` renders the GGUF's `tokenizer.chat_template`
    with llama-cpp-python's Jinja2 formatter (transformers' rendering rules);
    `eos_token_ids` are the ids llama.cpp treats as end of generation (`llama_vocab_is_eog`).
    """

    def __init__(self, llama: Any) -> None:
        self.llama = llama
        self._vocab_p = llama._model.vocab
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(self._vocab_p))
        meta = dict(llama.metadata)
        self.chat_template: str | None = meta.get("tokenizer.chat_template") or None
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab_p))
        bos = int(llama_cpp.llama_vocab_bos(self._vocab_p))
        eos = int(llama_cpp.llama_vocab_eos(self._vocab_p))
        self.bos_token_id: int | None = bos if bos >= 0 else None
        self.eos_token_id: int | None = eos if eos >= 0 else None
        self.bos_token: str | None = self._text(bos) if bos >= 0 else None
        self.eos_token: str | None = self._text(eos) if eos >= 0 else None
        self._attrs = [
            int(llama_cpp.llama_vocab_get_attr(self._vocab_p, i)) for i in range(self.vocab_size)
        ]
        marked = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        eog = {
            i for i, a in enumerate(self._attrs)
            if a & marked and llama_cpp.llama_vocab_is_eog(self._vocab_p, i)
        }
        if self.eos_token_id is not None:
            eog.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eog)
        self._compiled: Vocab | None = None
        self._formatter: Any = None

    def _text(self, token: int) -> str:
        return llama_cpp.llama_vocab_get_text(self._vocab_p, token).decode("utf-8", "replace")

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; a BOS is added when the model wants one and asked to."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(
            self.llama.tokenize(
                text.encode("utf-8"), add_bos=add_special_tokens and self.add_bos, special=True
            )
        )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """llama.cpp's streamed text for `ids`: their pieces, concatenated, decoded."""
        buf = ctypes.create_string_buffer(256)
        data = b"".join(_piece(self._vocab_p, int(i), not skip_special_tokens, buf) for i in ids)
        return data.decode("utf-8", "replace")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Render `messages` with the GGUF's chat template; token ids unless tokenize=False."""
        if self.chat_template is None:
            raise ValueError("this GGUF model has no tokenizer.chat_template")
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        formatter = Jinja2ChatFormatter(
            template=self.chat_template,
            eos_token=self.eos_token or "",
            bos_token=self.bos_token or "",
            add_generation_prompt=add_generation_prompt,
        )
        text = formatter(messages=[dict(m) for m in messages], **kwargs).prompt
        if not tokenize:
            return text
        add_bos = self.bos_token is None or not text.startswith(self.bos_token)
        ids = self.encode(text, add_special_tokens=add_bos)
        return {"input_ids": ids} if return_dict else ids

    def __tokentrail_vocab__(self) -> Vocab:
        """The `Vocab` of llama.cpp's decode: `llama_token_to_piece(id, special=True)` per
        id; control tokens are `special` (llama.cpp prints them only when asked to)."""
        if self._compiled is None:
            buf = ctypes.create_string_buffer(256)
            pieces: list[bytes | None] = []
            names: dict[int, str] = {}
            control = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
            special = set()
            for i in range(self.vocab_size):
                piece = _piece(self._vocab_p, i, True, buf)
                pieces.append(piece)
                if self._attrs[i] & control:
                    special.add(i)
                if not piece:
                    names[i] = self._text(i)
            self._compiled = Vocab(
                pieces,
                name=f"llama.cpp:{Path(self.llama.model_path).name}",
                special=frozenset(special),
                byte_mode="stream",
                names=names,
                oracle=lambda ids, skip: self.decode(ids, skip_special_tokens=skip),
                source=self,
            )
        return self._compiled


# -- the engine --------------------------------------------------------------------------


class LazyLogprobs:
    """The full logprob vector of one step, computed only when asked for.

    llama.cpp overwrites its logits buffer at the next decode, so the vector can be read
    (``np.asarray(step.logprobs)``) until the generator advances; after that it raises.
    """

    __slots__ = ("_affected", "_engine", "_logits", "_lse", "_serial")

    def __init__(
        self, engine: LlamaCppEngine, logits: np.ndarray, lse: float, affected: dict[int, float]
    ) -> None:
        self._engine = engine
        self._serial = engine._serial
        self._logits = logits
        self._lse = lse
        self._affected = affected

    @property
    def shape(self) -> tuple[int]:
        return (self._logits.shape[0],)

    def __len__(self) -> int:
        return self._logits.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self._engine._serial != self._serial:
            raise RuntimeError(
                "this step's logprobs are gone: llama.cpp reuses its logits buffer at the "
                "next step; read np.asarray(response.logprobs) before advancing the stream"
            )
        out = self._logits.astype(np.float32) - np.float32(self._lse)
        for i, v in self._affected.items():
            out[i] = v - self._lse
        return out if dtype is None else out.astype(dtype)

    def tolist(self) -> list[float]:
        return self.__array__().tolist()


class LlamaCppEngine:
    """Runs a llama-cpp-python `Llama`; see `tokentrail.engines.Engine`.

    `Step.logprob` is log p(token) after logit bias and the repeat penalty, before
    temperature and the top-k/top-p/min-p filters (as on the other engines); with neither,
    it equals llama-cpp-python's own `logprobs` (a log-softmax of the raw logits).
    """

    name = "llamacpp"

    def __init__(self, llama: Any) -> None:
        if not isinstance(llama, llama_cpp.Llama):
            raise TypeError(f"LlamaCppEngine needs a llama_cpp.Llama, got {type(llama).__name__}")
        self.llama = llama
        self.tokenizer = LlamaCppTokenizer(llama)
        self.vocab_size: int | None = self.tokenizer.vocab_size
        self.context_length: int | None = int(llama.n_ctx())
        self._serial = 0  # bumped at every decode: which logits the buffer holds
        self._owner: object = None  # the generator whose sequence is in the KV cache
        self._scratch = np.empty(self.vocab_size or 0, dtype=np.float32)

    @property
    def model_path(self) -> str:
        return str(self.llama.model_path)

    def peak_memory(self) -> float:
        """0.0: llama.cpp does not report its peak memory use."""
        return 0.0

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> Iterator[Step]:
        """Yield Steps; see `Engine.generate`. Arguments are checked here, at the call."""
        ids = check_generate_args(prompt_ids, params, max_tokens, self.vocab_size)
        if self.context_length is not None and len(ids) >= self.context_length:
            raise ValueError(
                f"prompt is {len(ids)} tokens, which leaves no room in the context of "
                f"{self.context_length} tokens (load with a larger n_ctx)"
            )
        return self._steps(ids, params, max_tokens)

    # -- internals --

    def _sampler(self, params: SamplingParams, prompt: list[int]) -> Any:
        from llama_cpp._internals import LlamaSampler

        chain = LlamaSampler()
        n_vocab = self.vocab_size or 0
        if params.logit_bias:
            chain.add_logit_bias(n_vocab, dict(params.logit_bias))
        penalty = params.repetition_penalty
        if penalty is not None and penalty != 1.0:
            chain.add_penalties(n_vocab, REPETITION_CONTEXT_SIZE, penalty, 0.0, 0.0)
        if params.temp == 0:
            chain.add_greedy()
        else:
            if params.top_k > 0:
                chain.add_top_k(params.top_k)
            if params.top_p < 1.0:
                chain.add_top_p(params.top_p, 1)
            if params.min_p > 0.0:
                chain.add_min_p(params.min_p, 1)
            chain.add_temp(params.temp)
            chain.add_dist(_DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF)
        if penalty is not None and penalty != 1.0:
            for t in prompt[-REPETITION_CONTEXT_SIZE:]:
                chain.accept(t)  # the prompt counts towards the penalty (llama-server)
        return chain

    def _eval(self, owner: object, sequence: list[int], new: list[int]) -> None:
        """Make the KV cache hold `sequence + new` (reusing what it holds), run the model."""
        llama = self.llama
        target = sequence + new
        if self._owner is not owner or llama.n_tokens != len(sequence):
            cached = llama.input_ids[: llama.n_tokens].tolist()
            keep = 0
            for a, b in zip(cached, target, strict=False):
                if a != b:
                    break
                keep += 1
            keep = min(keep, len(target) - 1)  # decode at least one token: fresh logits
            llama.n_tokens = keep
            new = target[keep:]
        self._owner = owner
        llama.eval(new)
        self._serial += 1

    def _logprobs(
        self, token: int, k: int, bias: Mapping[int, float] | None, window: deque[int],
        penalty: float | None,
    ) -> tuple[float, list[tuple[int, float]], LazyLogprobs]:
        """logprob of `token` and the top-k, from llama.cpp's logits (a numpy view)."""
        n = self.vocab_size or 0
        ptr = llama_cpp.llama_get_logits_ith(self.llama._ctx.ctx, -1)
        x = np.ctypeslib.as_array(ptr, shape=(n,))
        affected: dict[int, float] = {}
        if bias:
            for i, b in bias.items():
                affected[i] = float(x[i]) + b
        if penalty is not None and penalty != 1.0:
            for i in set(window):
                v = affected.get(i, float(x[i]))
                affected[i] = v * penalty if v <= 0 else v / penalty
        n_blocks = n // _TOPK_BLOCK
        want = k + len(affected)
        if n_blocks > want:
            head = x[: n_blocks * _TOPK_BLOCK].reshape(n_blocks, _TOPK_BLOCK)
            block_max = head.max(axis=1)
            m = float(block_max.max())
            if n_blocks * _TOPK_BLOCK < n:
                m = max(m, float(x[n_blocks * _TOPK_BLOCK :].max()))
        else:
            block_max = None
            m = float(x.max())
        if affected:
            m = max(m, *affected.values())
        scratch = self._scratch
        np.subtract(x, np.float32(m), out=scratch)
        np.exp(scratch, out=scratch)
        total = float(scratch.sum(dtype=np.float64))
        for i, v in affected.items():
            total += math.exp(v - m) - math.exp(float(x[i]) - m)
        lse = m + math.log(total)
        value = affected.get(token)
        lp = (float(x[token]) if value is None else value) - lse
        top: list[tuple[int, float]] = []
        if k:
            if block_max is not None:
                best = np.argpartition(block_max, n_blocks - want)[n_blocks - want :]
                cand = (best[:, None] * _TOPK_BLOCK + np.arange(_TOPK_BLOCK)).ravel()
                if n_blocks * _TOPK_BLOCK < n:
                    cand = np.concatenate([cand, np.arange(n_blocks * _TOPK_BLOCK, n)])
            else:
                cand = np.arange(n)
            vals = x[cand]
            if len(cand) > want:
                pick = np.argpartition(vals, len(cand) - want)[len(cand) - want :]
                cand, vals = cand[pick], vals[pick]
            scored = {int(i): float(v) for i, v in zip(cand.tolist(), vals.tolist(), strict=True)}
            scored.update(affected)
            best_k = sorted(scored.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
            top = [(i, v - lse) for i, v in best_k]
        return lp, top, LazyLogprobs(self, x, lse, affected)

    def _steps(
        self, ids: list[int], params: SamplingParams, max_tokens: int | None
    ) -> Iterator[Step]:
        owner = object()
        chain = self._sampler(params, ids)
        penalty = params.repetition_penalty
        window: deque[int] = deque(ids[-REPETITION_CONTEXT_SIZE:], maxlen=REPETITION_CONTEXT_SIZE)
        sequence: list[int] = []
        pending = ids
        n = 0
        try:
            while max_tokens is None or n < max_tokens:
                if len(sequence) + len(pending) >= (self.context_length or 1 << 62):
                    raise ValueError(
                        f"the context of {self.context_length} tokens is full after "
                        f"{n} generated tokens"
                    )
                self._eval(owner, sequence, pending)
                sequence.extend(pending)
                token = int(chain.sample(self.llama._ctx, -1))  # also accepts it
                lp, top, full = self._logprobs(
                    token, params.top_logprobs, params.logit_bias, window, penalty
                )
                window.append(token)
                n += 1
                yield Step(token, lp, top, full)
                pending = [token]
        finally:
            chain.close()
