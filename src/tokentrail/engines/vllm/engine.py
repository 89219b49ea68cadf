"""The vLLM engine: vLLM's scheduler, kernels and parallelism behind tokentrail's Step stream.

vLLM runs in process. `load` starts vLLM's `AsyncLLM` (tensor / pipeline parallel over
GPUs, and over nodes with Ray) on one asyncio loop of the engine's, in a background
thread, so that any number of threads can stream at once and vLLM batches them
continuously. The server's batch (`VLLMEngine.open_batch`: `tokentrail.engines.vllm.batch`)
runs each sequence as a task on that same loop.
Each request asks for `logprobs=k` with `RequestOutputKind.DELTA`: every output carries
the new token ids and, per token, the sampled token's logprob and the top-k
alternatives, which become `Step`s. Text, attribution and stop strings stay
tokentrail's: vLLM's detokenizer is switched off, and so is its EOS stop (the shared
loop stops on the tokenizer's end tokens, as with every engine).

Differences from the MLX and torch engines, all vLLM's own semantics:

* `Step.logprobs` (the full vector) is None: vLLM returns only the top-k.
* Logprobs are vLLM's default `raw_logprobs`: the model's distribution before logit
  bias and repetition penalty (identical to the other engines when neither is set).
  `load` refuses another engine-wide `logprobs_mode`, which its steps would mislabel.
  Under a constraint vLLM masks the logits before any logprobs, so those steps carry
  `distribution` "masked" and no `allowed_mass` (`tokentrail.engines.vllm.steps`).
* vLLM applies temperature before top-p and min-p (mlx-lm after), and its repetition
  penalty covers the whole prompt and output (mlx-lm: the last 20 tokens).
* A seed reproduces a stream on the same deployment; the tokens differ from torch/MLX.

vLLM itself is imported only when used; without it, `load` raises an ImportError that
says how to install it.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import inspect
import json
import logging
import os
import queue
import threading
import uuid
import weakref
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

from ...sampling import SamplingParams
from .. import reaper
from ..base import Step, check_generate_args
from ..batch import SerialBatch
from ..config import config_eos_ids, is_hub_id
from .batch import VLLMBatch
from .steps import distribution_of, step_from_logprobs, steps_from_completion

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "vLLM is not installed: pip install vllm (Linux with an NVIDIA or AMD GPU; "
    "see docs/engines.md for multi-GPU and multi-node set-up)"
)
#: Extra engine arguments as a JSON object, e.g. '{"enforce_eager": true}'; merged under
#: the keyword arguments given to `load`, so `tokentrail serve` can pass any of them.
ARGS_ENV = "TOKENTRAIL_VLLM_ARGS"
#: `load`'s engine arguments when neither a keyword nor ``TOKENTRAIL_VLLM_ARGS`` sets them.
DEFAULTS: dict[str, Any] = {
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "dtype": "auto",
    "max_model_len": None,
    "gpu_memory_utilization": 0.9,
}

__all__ = [
    "ARGS_ENV",
    "DEFAULTS",
    "INSTALL_HINT",
    "VLLMEngine",
    "accepts",
    "load",
    "step_from_logprobs",
    "steps_from_completion",
    "wrap",
]


#: Where vLLM's own log lines go. vLLM logs to stdout unless told otherwise; tokentrail's
#: stdout is the output (`tokentrail generate`), so its logs go to stderr. Set before vLLM
#: is first imported (an explicit VLLM_LOGGING_STREAM wins); its worker processes inherit it.
LOGGING_STREAM = "ext://sys.stderr"


def _require_vllm() -> Any:
    os.environ.setdefault("VLLM_LOGGING_STREAM", LOGGING_STREAM)
    try:
        import vllm
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return vllm


def load(
    path: str | os.PathLike[str],
    *,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    dtype: str | None = None,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    **engine_args: Any,
) -> tuple[VLLMEngine, Any]:
    """Start vLLM on the model at `path`; return (engine, tokenizer).

    The engine is a ready `VLLMEngine` (pass it to `stream_generate` as the model); the
    tokenizer is transformers' `AutoTokenizer` with `eos_token_ids` from the generation
    config. Keyword arguments are vLLM engine arguments (`AsyncEngineArgs` fields, e.g.
    `enforce_eager=True`, `distributed_executor_backend="ray"`), as are the keys of the
    JSON object in the ``TOKENTRAIL_VLLM_ARGS`` environment variable (keywords given
    win; a keyword left None takes the variable's value, else `DEFAULTS`' own). So
    ``TOKENTRAIL_VLLM_ARGS='{"dtype": "float32"}'`` reaches `tokentrail generate`, which
    has no vLLM flags (vLLM's CPU build picks bfloat16 for "auto").
    """
    _require_vllm()
    from vllm.engine.arg_utils import AsyncEngineArgs

    from ..torch_engine import load_tokenizer

    p = Path(path).expanduser()
    local = p.exists()
    if local:
        if not p.is_dir():
            raise ValueError(f"model path must be a folder with config.json and weights, got {p}")
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in model folder {p}")
        source = str(p)
    elif is_hub_id(path):
        source = path  # vLLM downloads it: the only case that touches the network
    else:
        raise FileNotFoundError(f"model folder not found: {p}")
    given = {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "gpu_memory_utilization": gpu_memory_utilization,
    }
    args: dict[str, Any] = {**DEFAULTS, **_env_args()}
    args.update({k: v for k, v in given.items() if v is not None})
    args.update(engine_args)
    args["model"] = source
    mode = args.get("logprobs_mode")
    if mode not in (None, "raw_logprobs"):
        # The steps are labelled from the request alone ("raw", or "masked" under a
        # constraint): another engine-wide mode would be labelled wrongly (logits, or
        # processed logprobs, as "raw").
        raise ValueError(
            f"bad vLLM engine argument logprobs_mode={mode!r}: tokentrail reads vLLM's "
            "default raw_logprobs and labels them; leave it unset (processed logprobs per "
            "request: the MLX, torch or llama.cpp engines)"
        )
    try:
        engine_args_obj = AsyncEngineArgs(**args)
    except TypeError as e:
        raise ValueError(f"bad vLLM engine argument: {e}") from e
    engine = VLLMEngine.from_engine_args(engine_args_obj)
    try:
        tokenizer = load_tokenizer(source, eos_token_ids=_eos_ids(source), local=local)
    except BaseException:
        engine.shutdown()
        raise
    return engine, tokenizer


def _env_args() -> dict[str, Any]:
    raw = os.environ.get(ARGS_ENV)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ARGS_ENV} must be a JSON object of vLLM engine arguments: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{ARGS_ENV} must be a JSON object, got {type(value).__name__}")
    return value


def _eos_ids(source: str) -> list[int]:
    """End ids from the generation config, else the model config (as mlx-lm and torch)."""
    from transformers import AutoConfig, GenerationConfig

    ids = config_eos_ids(_read_config(GenerationConfig, source))
    return ids or config_eos_ids(_read_config(AutoConfig, source))


def _read_config(kind: Any, source: str) -> Any:
    try:
        return kind.from_pretrained(source)
    except (OSError, ValueError):
        return None


def accepts(model: Any) -> bool:
    """Whether `model` is a vLLM `AsyncLLM` / `AsyncLLMEngine` or offline `LLM` object."""
    cls = type(model)
    return cls.__module__.startswith("vllm") and cls.__name__ in (
        "AsyncLLM",
        "AsyncLLMEngine",
        "LLM",
    )


def wrap(model: Any) -> VLLMEngine:
    return VLLMEngine(model)


class _Loop:
    """An asyncio loop on a daemon thread: where AsyncLLM lives and all its calls run."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="tokentrail-vllm", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run the plain function `fn(*args)` on the loop's thread and return its result."""

        async def run() -> Any:
            return fn(*args)

        return self.submit(run()).result()

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class VLLMEngine:
    """Runs a vLLM engine; see `tokentrail.engines.Engine`.

    Wraps an `AsyncLLM` (streams from any number of threads at once, batched by vLLM)
    or an offline `vllm.LLM` (one stream at a time, stepped in the caller's thread).
    An `AsyncLLM` must have been created outside a running event loop (`load` and
    `from_engine_args` do this for you): its output handler then starts on the
    engine's own loop.
    """

    name = "vllm"

    def __init__(self, engine: Any, *, _loop: _Loop | None = None) -> None:
        self.engine = engine
        self._offline = hasattr(engine, "llm_engine")  # vllm.LLM
        # An AsyncLLM's calls all run on one loop of ours; an offline LLM needs none.
        self._loop: _Loop | None = None if self._offline else (_loop or _Loop())
        self._busy = threading.Lock()
        self._closed = False
        self._guard: reaper.Watcher | None = None
        if not self._offline:
            # AsyncLLM.__del__ shuts vLLM down when the interpreter is already tearing its
            # modules down, and fails there (`Exception ignored in AsyncLLM.__del__ ...
            # TypeError`); shut it down first, while everything is still in place.
            atexit.register(_shutdown_at_exit, weakref.ref(self))
        model_config = _model_config(engine)
        self.vocab_size: int | None = None
        self.context_length: int | None = None
        if model_config is not None:
            get_vocab = getattr(model_config, "get_vocab_size", None)
            self.vocab_size = int(get_vocab()) if callable(get_vocab) else None
            max_len = getattr(model_config, "max_model_len", None)
            self.context_length = int(max_len) if max_len else None
        #: Sequences vLLM's scheduler runs at once (its `max_num_seqs`); None if unknown.
        self.max_num_seqs: int | None = _max_num_seqs(engine)

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> VLLMEngine:
        """Start an `AsyncLLM` from `AsyncEngineArgs` on a fresh background loop."""
        _require_vllm()
        try:
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError:  # older releases export it under its V0 name only
            from vllm import AsyncLLMEngine as AsyncLLM

        loop = _Loop()
        before = reaper.descendants()
        try:
            engine = loop.call(AsyncLLM.from_engine_args, engine_args)
        except BaseException:
            loop.stop()
            raise
        out = cls(engine, _loop=loop)
        # vLLM's engine processes outlive a killed parent (`kill -9`): a watcher ends them.
        out._guard = reaper.guard(before)
        return out

    def open_batch(self, max_batch: int | None = None, **options: Any) -> Any:
        """The server's batch: a `VLLMBatch` (every sequence a task on the engine's loop,
        its outputs pushed as vLLM makes them), at vLLM's `max_num_seqs` when `max_batch`
        is None. An offline `vllm.LLM` streams one request at a time: a `SerialBatch`.
        `options` (e.g. `prompt_cache_bytes`) are for engines with a prompt cache of
        tokentrail's; vLLM caches prefixes itself (`enable_prefix_caching`), so they are
        ignored here."""
        if options:
            log.debug("vLLM batch: options %s ignored (vLLM has its own prefix cache)", options)
        if self._offline:
            return SerialBatch(self, max_batch)
        return VLLMBatch(self, max_batch)

    def prepare(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> tuple[list[int], Any]:
        """The checked prompt ids and vLLM `SamplingParams` for one request (ValueError,
        TypeError for bad input, as `generate` raises them)."""
        ids = check_generate_args(prompt_ids, params, max_tokens, self.vocab_size)
        return ids, _sampling_params(params, max_tokens, self.vocab_size)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run `coro` on the engine's loop (where AsyncLLM lives); its future.

        Cancelling the future cancels the task on the loop."""
        if self._loop is None:
            raise RuntimeError("an offline vllm.LLM has no event loop")
        return self._loop.submit(coro)

    @property
    def offline(self) -> bool:
        """Whether this wraps an offline ``vllm.LLM`` (one stream at a time, no loop)."""
        return self._offline

    def peak_memory(self) -> float:
        """0.0: vLLM reserves `gpu_memory_utilization` of each GPU in worker processes."""
        return 0.0

    def shutdown(self) -> None:
        """Stop vLLM's workers and the background loop (once; later calls do nothing).

        Called at interpreter exit for an engine not shut down before.
        """
        if self._closed:
            return
        self._closed = True
        shutdown = getattr(self.engine, "shutdown", None)
        if callable(shutdown):
            if self._loop is not None and not self._offline:
                self._loop.call(_graceful, shutdown)
            else:
                shutdown()
        if self._loop is not None:
            self._loop.stop()
        if not self._offline and callable(shutdown):
            _release(self.engine)
        if self._guard is not None:  # vLLM's processes are shut down: nothing to end
            self._guard.stand_down()


    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> Iterator[Step]:
        """Yield Steps; see `Engine.generate`. Arguments are checked here, at the call."""
        ids, sampling = self.prepare(prompt_ids, params, max_tokens)
        k, dist = params.top_logprobs, distribution_of(params)
        if self._offline:
            return self._offline_steps(ids, sampling, k, dist)
        return self._async_steps(ids, sampling, k, dist)

    # -- the two drivers --

    def _async_steps(self, ids: list[int], sampling: Any, k: int, dist: str) -> Iterator[Step]:
        assert self._loop is not None
        request_id = f"tokentrail-{uuid.uuid4().hex}"
        out: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        engine = self.engine

        async def pump() -> None:
            stream = engine.generate({"prompt_token_ids": ids}, sampling, request_id)
            try:
                async for output in stream:
                    for completion in output.outputs:
                        out.put(("steps", steps_from_completion(completion, k, dist), None))
                    if output.finished:
                        break
            except asyncio.CancelledError:
                raise  # the reader closed the stream; AsyncLLM aborts the request
            except BaseException as e:
                out.put(("error", e, None))
                return
            finally:
                await stream.aclose()
            out.put(("end", None, None))

        future = self._loop.submit(pump())
        try:
            while True:
                kind, item, _ = out.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise item
                yield from item
        finally:
            if not future.done():
                future.cancel()  # cancels pump(): vLLM aborts the request, no more steps

    def _offline_steps(self, ids: list[int], sampling: Any, k: int, dist: str) -> Iterator[Step]:
        llm_engine = self.engine.llm_engine
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                "this vllm.LLM is already streaming a request; an offline LLM runs one stream "
                "at a time (use tokentrail.engines.vllm.engine.load for concurrent streams)"
            )
        request_id = f"tokentrail-{uuid.uuid4().hex}"
        finished = False
        try:
            llm_engine.add_request(request_id, {"prompt_token_ids": ids}, sampling)
            while not finished:
                for output in llm_engine.step():
                    if output.request_id != request_id:
                        continue
                    finished = bool(output.finished)
                    for completion in output.outputs:
                        logprobs = completion.logprobs
                        for i, tid in enumerate(completion.token_ids):
                            position = None if logprobs is None else logprobs[i]
                            yield step_from_logprobs(tid, position, k, dist)
        finally:
            if not finished:
                llm_engine.abort_request([request_id])
            self._busy.release()


#: Seconds vLLM's engine process gets to exit on its own at shutdown before vLLM kills
#: it (vLLM's default is 5 s, too short on a busy CPU machine: the kill leaks its shared
#: memory, which Python then warns about at exit).
SHUTDOWN_GRACE = 30.0


def _graceful(shutdown: Any) -> None:
    """`AsyncLLM.shutdown`, with `SHUTDOWN_GRACE` where the release takes a timeout."""
    try:
        takes_timeout = "timeout" in inspect.signature(shutdown).parameters
    except (TypeError, ValueError):
        takes_timeout = False
    if takes_timeout:
        shutdown(timeout=SHUTDOWN_GRACE)
    else:
        shutdown()


def _release(engine: Any) -> None:
    """After `AsyncLLM.shutdown`: make its `__del__` (which shuts down again) harmless.

    `AsyncLLM.__del__` calls `shutdown` once more whenever the object is collected; at
    interpreter teardown the module globals that needs are already None (`TypeError:
    'NoneType' object is not callable`). Its work is done, so the instance's own
    `shutdown` becomes a no-op.
    """
    with contextlib.suppress(AttributeError, TypeError):
        engine.shutdown = _done


def _done(*args: Any, **kwargs: Any) -> None:
    """An AsyncLLM's `shutdown` once it has been shut down: nothing left to do."""


def _shutdown_at_exit(ref: weakref.ref[VLLMEngine]) -> None:
    engine = ref()
    if engine is None or engine._closed:
        return
    try:
        engine.shutdown()
    except Exception as e:  # exiting anyway: say so, do not raise at exit
        log.warning("shutting vLLM down at exit failed: %s: %s", type(e).__name__, e)


def _max_num_seqs(engine: Any) -> int | None:
    config = getattr(engine, "vllm_config", None)
    if config is None:
        config = getattr(getattr(engine, "llm_engine", None), "vllm_config", None)
    value = getattr(getattr(config, "scheduler_config", None), "max_num_seqs", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def _model_config(engine: Any) -> Any:
    config = getattr(engine, "model_config", None)
    if config is None:
        inner = getattr(engine, "llm_engine", None)
        config = getattr(inner, "model_config", None)
    return config


def _sampling_params(params: SamplingParams, max_tokens: int | None, vocab: int | None) -> Any:
    """vLLM `SamplingParams` for tokentrail's settings: DELTA outputs with top-k logprobs."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    top_k = params.top_k if params.top_k > 0 and (vocab is None or params.top_k < vocab) else -1
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": params.temp,
        "top_p": params.top_p,
        "top_k": top_k,
        "min_p": params.min_p,
        "seed": params.seed,
        "max_tokens": max_tokens,
        "logprobs": params.top_logprobs,  # 0: only the sampled token's logprob
        "ignore_eos": True,  # the shared loop stops on the tokenizer's end tokens
        "detokenize": False,  # tokentrail makes the text
        "skip_special_tokens": False,
        "output_kind": RequestOutputKind.DELTA,
    }
    if params.repetition_penalty is not None:
        kwargs["repetition_penalty"] = params.repetition_penalty
    if params.presence_penalty:
        kwargs["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        kwargs["frequency_penalty"] = params.frequency_penalty
    if params.logit_bias:
        kwargs["logit_bias"] = dict(params.logit_bias)
    if params.logprobs_mode != "raw":
        raise ValueError(
            "vLLM sets logprobs_mode for the whole engine (LLM(logprobs_mode=...)), not per "
            "request; this engine reports its raw logprobs"
        )
    if params.constraint is not None:
        kwargs.update(_structured_outputs(params.constraint))
    return VLLMSamplingParams(**kwargs)


def _structured_outputs(constraint: Any) -> dict[str, Any]:
    """vLLM's own structured outputs for a tokentrail `Constraint` (the same request
    fields, passed through): `structured_outputs` (vLLM >= 0.10.2) or the older
    `guided_decoding`."""
    from ..upstream.constraints import vllm_structured_outputs

    fields = vllm_structured_outputs(constraint.kind, constraint.source)
    try:
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(**fields)}
    return {"structured_outputs": StructuredOutputsParams(**fields)}
