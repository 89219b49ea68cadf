"""The llama.cpp engine: GGUF models through llama-cpp-python, llama.cpp's own sampler
chain, and logprobs read from a view over llama.cpp's logits buffer.

* Decoding uses the `llama_cpp.Llama` object's `eval` (llama.cpp's batches and KV cache,
  with the longest common prefix of the previous sequence reused, as `Llama.generate`).
* Sampling is a llama.cpp sampler chain (`llama_sampler_*`) in llama-cpp-python's order:
  logit bias, penalties (repeat, frequency, presence), top-k, top-p, min-p, temperature,
  then a seeded `dist` sampler (or `greedy` at temperature 0). The same seed and
  settings draw the same tokens as `Llama.create_completion` (without penalties; with
  one, the prompt also counts, as in llama-server).
* Each step's logprob and top-k come from `llama_get_logits_ith` read through a numpy
  view (no copy): one pass for the log-normalizer, a blockwise max to find the top-k,
  and exact corrections for the few ids that logit bias or the penalties changed.
  `Step.logprobs` is a lazy view of the full vector, materialised only if asked for.
* The tokenizer (`LlamaCppTokenizer`) is llama.cpp's own: its `Vocab` is built from
  `llama_token_to_piece` for every id and the token attributes (control tokens are
  special), so the streamed text is byte for byte what llama.cpp streams.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from ...sampling import SamplingParams
from ...vocab import Vocab
from ..base import RewindableBase, Step, check_generate_args
from ..config import continue_last
from ..gguf_models import GGUFError, check_magic, explain_llamacpp_failure, gguf_source
from .batch import LlamaCppBatch
from .guided import guided_chain, guided_step
from .sampling import REPEAT_LAST_N, LazyLogprobs, make_sampler, penalizes, step_logprobs

log = logging.getLogger(__name__)

#: Default context when the model's own is larger (its KV cache is allocated up front).
DEFAULT_N_CTX = 4096
#: `load`'s `flash_attn` modes -> llama.cpp's `llama_flash_attn_type`.
FLASH_ATTN_TYPES = {
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}

__all__ = [
    "FLASH_ATTN_TYPES",
    "LlamaCppEngine",
    "LlamaCppRewindable",
    "LlamaCppTokenizer",
    "accepts",
    "flash_attn_mode",
    "kv_unified_mode",
    "load",
    "wrap",
]


def load(
    path: str | os.PathLike[str],
    *,
    n_ctx: int | None = None,
    n_threads: int | None = None,
    n_gpu_layers: int = 0,
    n_batch: int = 512,
    flash_attn: bool | str = "auto",
    kv_unified: bool | str = True,
) -> tuple[LlamaCppEngine, LlamaCppTokenizer]:
    """Load a `.gguf` model file (or a named model such as ``smollm2``) with llama.cpp.

    `n_ctx` defaults to the model's training context, at most 4096 tokens; `n_threads`
    (CPU threads for generation and for prompts, as llama-server's ``-t``) to
    llama-cpp-python's defaults; `n_gpu_layers` offloads layers where llama.cpp was
    built with a GPU backend. `flash_attn` is llama.cpp's flash attention: "auto" (the
    default, as llama-server's ``-fa auto``: on where the backend has the kernel, which
    the CPU backend does), "on"/True or "off"/False (llama-cpp-python's default: its
    decode's logprobs exactly; flash attention moves them by about 1e-3, see
    docs/engines.md). The batch's context inherits it (asking llama.cpp for "auto"
    itself); llama-cpp-python can only say on or off for the `Llama`'s own context, so
    "auto" is on there. `kv_unified` is the KV cache layout of the engine's batches
    (`LlamaCppBatch`): True/"on" (the default) one cache shared by the sequences,
    False/"off" a share of `n_ctx` per sequence, "auto" llama-server's rule (shared
    unless the batch's slot count is given). Returns (engine, tokenizer) for
    `stream_generate`.
    """
    mode = flash_attn_mode(flash_attn)
    layout = kv_unified_mode(kv_unified)
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
    kwargs["flash_attn"] = mode != "off"
    if n_threads is not None:  # for generation and prompts alike, as llama-server's -t
        kwargs["n_threads"] = kwargs["n_threads_batch"] = n_threads
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
    engine.flash_attn_type = FLASH_ATTN_TYPES[mode]
    engine.kv_unified = layout
    return engine, engine.tokenizer


def kv_unified_mode(value: bool | str) -> bool | str:
    """`load`'s `kv_unified` as True, False or "auto" ("on"/"off" are True/False)."""
    if isinstance(value, bool):
        return value
    named = {"on": True, "off": False, "auto": "auto"}
    if isinstance(value, str) and value in named:
        return named[value]
    raise ValueError(f"kv_unified must be 'auto', 'on' or 'off' (or a bool), got {value!r}")


def flash_attn_mode(value: bool | str) -> str:
    """`load`'s `flash_attn` as "auto", "on" or "off" (True: on, False: off)."""
    if value is True or value is False:
        return "on" if value else "off"
    if isinstance(value, str) and value.lower() in FLASH_ATTN_TYPES:
        return value.lower()
    raise ValueError(f"flash_attn must be 'auto', 'on' or 'off' (or a bool), got {value!r}")


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
        self._vocab_p = llama_cpp.llama_model_get_vocab(llama.model)
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
            i
            for i, a in enumerate(self._attrs)
            if a & marked and llama_cpp.llama_vocab_is_eog(self._vocab_p, i)
        }
        if self.eos_token_id is not None:
            eog.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eog)
        self._compiled: Vocab | None = None
        self._formatters: dict[bool, Any] = {}  # add_generation_prompt -> its formatter

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
        """Render `messages` with the GGUF's chat template; token ids unless tokenize=False.
        ``continue_final_message`` leaves the last message open (`continue_last`)."""
        if self.chat_template is None:
            raise ValueError("this GGUF model has no tokenizer.chat_template")
        keep_going = bool(kwargs.pop("continue_final_message", False))
        add_generation_prompt = add_generation_prompt and not keep_going
        formatter = self._formatters.get(add_generation_prompt)
        if formatter is None:  # the template compiles once, not at every request
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            formatter = Jinja2ChatFormatter(
                template=self.chat_template,
                eos_token=self.eos_token or "",
                bos_token=self.bos_token or "",
                add_generation_prompt=add_generation_prompt,
            )
            self._formatters[add_generation_prompt] = formatter
        text = formatter(messages=[dict(m) for m in messages], **kwargs).prompt
        if keep_going:
            text = continue_last(text, str(messages[-1].get("content") or ""))
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


#: llama.cpp pads a context to a multiple of this many cells.
_CTX_PAD = 256


class LlamaCppEngine:
    """Runs a llama-cpp-python `Llama`; see `tokentrail.engines.Engine`.

    `Step.logprob` is log p(token) after logit bias and the penalties, before
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
        #: The flash attention a batch's context asks llama.cpp for (`load` sets "auto"
        #: there; a wrapped `Llama` passes on its own setting).
        self.flash_attn_type = int(llama.context_params.flash_attn_type)
        #: The KV cache layout of this engine's batches (`load`'s `kv_unified`).
        self.kv_unified: bool | str = True
        self.decodes = 0  # bumped at every decode: which logits the buffer holds
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
        return self._steps(ids, self.bound(params), max_tokens)

    # -- internals --

    def _sampler(self, params: SamplingParams, prompt: list[int], guided: Any = None) -> Any:
        return make_sampler(params, prompt, self.vocab_size or 0, guided)

    def bound(self, params: SamplingParams) -> SamplingParams:
        """`params` with its constraint bound to this model's tokenizer (if it is not)."""
        c = params.constraint
        if c is None or c.bound:
            return params
        return replace(params, constraint=c.bind(self.tokenizer))

    def generate_rewindable(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> LlamaCppRewindable:
        """A step stream that can take tokens back (`engines.base.RewindableSteps`, for
        field retry; see `LlamaCppRewindable`). A penalty is refused: llama.cpp's
        penalty sampler cannot forget the tokens taken back."""
        ids = check_generate_args(prompt_ids, params, max_tokens, self.vocab_size)
        if penalizes(params):
            raise ValueError(
                "field retry on llama.cpp does not take repetition_penalty, presence_penalty "
                "or frequency_penalty"
            )
        return LlamaCppRewindable(self, ids, self.bound(params), max_tokens)

    def open_batch(self, max_batch: int, **options: Any) -> LlamaCppBatch:
        """A `Batch` over llama.cpp's parallel sequences (see `llamacpp.batch`)."""
        return LlamaCppBatch(self, max_batch, **options)

    def solo_batch(
        self, longest: int, max_batch: int | None, most: int
    ) -> tuple[int, dict[str, Any]]:
        """How many sequences, and the batch options, for a private batch whose sequences
        must each equal their solo run (`stream_batch_generate`): a split KV cache (a
        unified one lets a sequence's logprobs, even its greedy tokens, move with its
        neighbours in llama.cpp), each share holding `longest` tokens (rounded up to
        llama.cpp's 256 cells, at most the engine's context). `max_batch` is kept when
        given; None takes as many as fit in the engine's own context (the memory its
        load asked for), at least one and at most `most`."""
        per = -(-max(1, longest) // _CTX_PAD) * _CTX_PAD
        if self.context_length:
            per = min(per, self.context_length)
        if max_batch is None:
            max_batch = max(1, min(most, (self.context_length or per) // per))
        return max_batch, {"kv_unified": False, "n_ctx": per * max_batch}

    def forget_context(self) -> None:
        """Empty the engine context's KV cache (after another use of it, `positions`):
        the next generation step finds it used by someone else and decodes its own
        sequence again."""
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.llama.ctx), -1, -1, -1)
        self.llama.n_tokens = 0
        self._owner = None

    def _eval(self, owner: object, sequence: list[int], new: list[int]) -> None:
        """Make the KV cache hold `sequence + new` (reusing what it holds), run the model."""
        llama = self.llama
        target = sequence + new
        if (
            self._owner is not owner
            or llama.n_tokens != len(sequence)
            or (sequence and int(llama.input_ids[len(sequence) - 1]) != sequence[-1])
        ):  # someone else (another stream, the Llama's own API) used the KV cache
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
        self.decodes += 1

    def _logprobs(
        self,
        token: int,
        k: int,
        bias: Mapping[int, float] | None,
        window: deque[int],
        params: SamplingParams | None,
    ) -> tuple[float, list[tuple[int, float]], LazyLogprobs]:
        """logprob of `token` and the top-k, from llama.cpp's logits (a numpy view), after
        `params`' penalties over `window` (None: none)."""
        ptr = llama_cpp.llama_get_logits_ith(self.llama.ctx, -1)
        x = np.ctypeslib.as_array(ptr, shape=(self.vocab_size or 0,))
        p = params
        lp, top, lse, affected = step_logprobs(
            x, token, k, bias, window, None if p is None else p.repetition_penalty,
            self._scratch, 0.0 if p is None else p.presence_penalty,
            0.0 if p is None else p.frequency_penalty,
        )  # fmt: skip
        return lp, top, LazyLogprobs(self, x, lse, affected)

    def _steps(
        self, ids: list[int], params: SamplingParams, max_tokens: int | None
    ) -> Iterator[Step]:
        owner = object()
        guided = guided_chain(params, self.vocab_size or 0)
        chain = self._sampler(params, ids, guided)
        window: deque[int] = deque(ids[-REPEAT_LAST_N:], maxlen=REPEAT_LAST_N)
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
                if guided is not None:
                    guided.prepare()
                # llama_sampler_sample also accepts the token into the chain.
                token = int(llama_cpp.llama_sampler_sample(chain.sampler, self.llama.ctx, -1))
                lp, top, full = self._logprobs(
                    token, params.top_logprobs, params.logit_bias, window, params
                )
                window.append(token)
                n += 1
                yield guided_step(guided, token, lp, top, full, params)
                pending = [token]
        finally:
            chain.close()


class LlamaCppRewindable(RewindableBase):
    """`engines.base.RewindableSteps` on llama.cpp: the engine's own steps (its `_eval`,
    sampler chain and logits view), one at a time, able to go back.

    `rewind(n)` drops the ids; the next decode finds the KV cache longer than the ids
    that stand and cuts it there (`Llama.eval` removes the cells past `n_tokens`:
    llama.cpp's `llama_kv_cache_seq_rm`), and the guide rolls back (`Guide.rollback`).
    Each temperature has its own sampler chain (so a retry's draws do not replay the
    first attempt's random numbers); with a seed, retries draw from seed + 1.
    """

    def __init__(
        self, engine: LlamaCppEngine, ids: list[int], params: SamplingParams,
        max_tokens: int | None,
    ) -> None:  # fmt: skip
        super().__init__(ids, params, max_tokens)
        self.engine = engine
        self.sequence: list[int] = []  # the ids the KV cache holds for this stream
        self.owner = object()
        self.guided = guided_chain(params, engine.vocab_size or 0)
        self.chains: dict[float, Any] = {}

    def _chain(self) -> Any:
        chain = self.chains.get(self.temp)
        if chain is None:
            p = self.params
            if self.temp != p.temp:
                p = replace(p, temp=self.temp, seed=None if p.seed is None else p.seed + 1)
            chain = self.chains[self.temp] = self.engine._sampler(p, self.ids, self.guided)
        return chain

    def __next__(self) -> Step:
        engine, p = self.engine, self.params
        if self._exhausted():
            raise StopIteration
        if len(self.ids) >= (engine.context_length or 1 << 62):
            raise ValueError(f"the context of {engine.context_length} tokens is full")
        pending = self.ids[len(self.sequence) :]
        engine._eval(self.owner, self.sequence, pending)
        self.sequence = list(self.ids)
        if self.guided is not None:
            self.guided.prepare()
        token = int(llama_cpp.llama_sampler_sample(self._chain().sampler, engine.llama.ctx, -1))
        lp, top, full = engine._logprobs(token, p.top_logprobs, p.logit_bias, deque(), None)
        self.ids.append(token)
        return guided_step(self.guided, token, lp, top, full, p)

    def rewind(self, n: int) -> None:
        self._check_rewind(n)
        if n == 0:
            return
        if self.guided is not None and self.guided.guide is not None:
            self.guided.guide.rollback(n)
        del self.ids[-n:]
        self.sequence = self.ids[: min(len(self.sequence), len(self.ids) - 1)]

    def force(self, ids: Sequence[int]) -> None:
        ids = [int(i) for i in ids]
        if self.guided is not None and self.guided.guide is not None:
            for i in ids:
                self.guided.guide.advance(i)
        self.ids += ids  # decoded with the next step

    def close(self) -> None:
        for chain in self.chains.values():
            chain.close()
        self.chains.clear()
        self.limit = 0
