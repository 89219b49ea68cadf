"""The server's settings, each declared once (`settings.declare`): `ServerConfig` (what
the app and the `Scheduler` run with, built from `tokentrail serve`'s flags or
`create_app`'s keywords), `ListenConfig` (how `tokentrail serve` listens and logs) and
`ENGINE_FLAGS` (the engine loaders' flags, which become `ServerConfig.load_options`).
Their flags, checks and defaults all come from these declarations.

This module imports no server dependency, so the `serve` parser loads without them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..batch import DEFAULT_MAX_BATCH
from ..errors import UsageError
from ..sampling import OPENAI_LIMITS, Range
from ..vocab import Vocab
from .settings import Flag, Setting, at_least, declare, settings_of, values_from_args

__all__ = [
    "DEFAULT_CLIENT_TIMEOUT",
    "DEFAULT_KEEP_ALIVE",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_BUFFERED",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_PROXY_MAX_QUEUE",
    "DEFAULT_READ_TIMEOUT",
    "ENGINES",
    "ENGINE_FLAGS",
    "ENGINE_OPTIONS",
    "ENGINE_SETTINGS",
    "LOG_LEVELS",
    "ListenConfig",
    "LoadedModel",
    "Loader",
    "ServerConfig",
    "engine_options",
    "served_name",
    "usable_cores",
    "worker_count",
]

#: What loads a model: a function returning (model, tokenizer), run on the loop thread.
Loader = Callable[[], tuple[Any, Any]]


@dataclass(frozen=True)
class LoadedModel:
    """What the loop thread loaded: the model and tokenizer, the engine that runs them,
    the tokenizer's vocabulary and EOS ids, the class of the engine's batch, and the
    calibration checked against the model."""

    model: Any
    tokenizer: Any
    engine: Any
    vocab: Vocab
    eos: frozenset[int]
    batch_kind: str
    #: The checked calibration (`config.calibration`), or None.
    calibration: Any = None
    #: The most tokens one request may hold: the batch's per-sequence context where it
    #: has one (a split KV cache), else the engine's.
    context_length: int | None = None


def served_name(model_path: str | os.PathLike[str] | None) -> str:
    """The model id served for a folder (its name), or tokentrail-demo for the demo."""
    if model_path is None:
        return "tokentrail-demo"
    return Path(model_path).resolve().name or str(model_path)

#: Sequences that may wait for room in the batch; more are answered 429.
DEFAULT_MAX_QUEUE = 16
#: The same for a proxy (`serve --upstream`): it holds no model, a waiting request costs
#: a few kilobytes, and the upstream queues what its slots cannot run yet, as it would
#: sent directly; so only a burst far past the upstream's slots is answered 429.
DEFAULT_PROXY_MAX_QUEUE = 1024
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: Default seconds a client may leave output unread before it is dropped.
DEFAULT_CLIENT_TIMEOUT = 30.0
#: Most steps one request may have unread before it is dropped.
DEFAULT_MAX_BUFFERED = 4096
#: Seconds a client has to send a whole request (headers and body) once it starts one.
DEFAULT_READ_TIMEOUT = 10.0
#: Seconds an idle keep-alive connection stays open.
DEFAULT_KEEP_ALIVE = 5.0
DEFAULT_MAX_CONNECTIONS = 256
LOG_LEVELS = ("debug", "info", "warning", "error")

#: The engines `--engine` names, in the order `--help` lists them.
ENGINES = ("mlx", "torch", "vllm", "llamacpp")

#: The engine loaders' flags (`tokentrail.load`'s keywords for the `engines` that take them).
ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("--device", "cuda, mps or cpu (default: best)", engines=("torch",)),
    Flag("--dtype", "float32, bfloat16, float16, auto", engines=("torch", "vllm")),
    Flag("--tensor-parallel-size", type=int, metavar="N", engines=("vllm",)),
    Flag("--pipeline-parallel-size", type=int, metavar="N", engines=("vllm",)),
    Flag("--gpu-memory-utilization", type=float, metavar="F", engines=("vllm",)),
    Flag("--max-model-len", type=int, metavar="N", engines=("vllm",)),
    Flag("--n-ctx", "context length", type=int, metavar="N", engines=("llamacpp",)),
    Flag("--n-threads", "CPU threads", type=int, metavar="N", engines=("llamacpp",)),
    Flag("--flash-attn", "llama.cpp's flash attention: {choices} (default: auto, as "
         "llama-server's -fa; off: llama-cpp-python's exact logprobs)",
         choices=lambda: ("auto", "on", "off"), engines=("llamacpp",)),
    Flag("--kv-unified", "llama.cpp's KV cache layout: {choices} (default: auto, as "
         "llama-server's -kvu: --n-ctx split evenly among the sequences when --max-batch is "
         "given, each request then fits --n-ctx / --max-batch tokens and its logprobs do "
         "not depend on its neighbours; one cache shared by them when it is left out; on: "
         "always shared, each request may use all of --n-ctx; off: always split)",
         choices=lambda: ("auto", "on", "off"), engines=("llamacpp",), serve_default="auto"),
    Flag("--n-gpu-layers", "layers to offload", type=int, metavar="N", engines=("llamacpp",)),
)
#: Engine name -> the loader keywords (flag names with "_") it takes.
ENGINE_OPTIONS: dict[str, tuple[str, ...]] = {
    engine: tuple(f.dest for f in ENGINE_FLAGS if engine in f.engines) for engine in ENGINES
}
#: `ENGINE_FLAGS` as settings, for `settings.add_flags` (no default: the loader's own).
ENGINE_SETTINGS = tuple(Setting(f.dest, None, (f,)) for f in ENGINE_FLAGS)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The chosen engine's loader keywords from the flags; UsageError for a flag that
    engine does not take."""
    options: dict[str, Any] = {}
    for flag in ENGINE_FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None:
            if flag.serve_default is not None and args.engine in flag.engines:
                options[flag.dest] = flag.serve_default
            continue
        if args.engine not in flag.engines:
            raise UsageError(f"{flag.name} does not apply to --engine {args.engine}")
        options[flag.dest] = value
    return options


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_count(text: str) -> int:
    """`--workers`' value: a count as written (its range is checked with the others'),
    or the usable cores for "auto"."""
    if text.strip().lower() == "auto":
        return usable_cores()
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of processes or 'auto', got {text!r}"
        ) from None


def _tool_parsers() -> list[str]:
    from ..structure.tools import TOOL_PARSERS

    return sorted(TOOL_PARSERS)


def _reasoning_parsers() -> list[str]:
    from ..structure.reasoning import REASONING_PARSERS

    return sorted(REASONING_PARSERS)


@dataclass(frozen=True)
class ServerConfig:
    """How one server runs: which model, how many sequences decode and wait, the limits
    on clients, and who may call it.

    `model_path` (None: the built-in demo model), `engine` ("mlx", "torch", "vllm",
    "llamacpp") and `load_options` (that engine's loader keywords) say what to load.
    `max_batch` sequences decode together (None, the default: the engine batch's
    capacity, `tokentrail.engines.batch.open_batch`) and `max_queue` more may wait.
    `prompt_cache_bytes` bounds the engine's prompt cache (None: the engine's default).
    A streaming client that leaves output unread for `client_timeout` seconds, or
    `max_buffered` steps, is dropped.
    Bodies over `max_body_bytes` get 413. `temperature` applies to requests without
    one. With `api_key`, ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer KEY``;
    with `allowed_hosts`, other `Host` names get 421 (IP literals and ``localhost``
    always pass; "*" passes everything). `reasoning` (a
    `tokentrail.structure.ReasoningFormat`, a `REASONING_PARSERS` name or (START, END)
    markers; None: none) splits chat replies into reasoning and content;
    `tool_call_parser` (a `tokentrail.structure.TOOL_PARSERS` name; None: detected from
    the chat template) parses tool calls. `calibration` (a file from `tokentrail
    calibrate --fit`, checked against the model's fingerprint at load) adds
    `confidence.calibrated` to every segment.
    """

    model_path: str | os.PathLike[str] | None = field(default=None, metadata=declare(
        Flag("--model", "model folder in Hugging Face layout", metavar="PATH"),
        default_note="the built-in demo model",
    ))
    model_name: str | None = field(default=None, metadata=declare(
        Flag("--model-name", "id the model is served under"),
        default_note="the folder name, or tokentrail-demo",
    ))
    engine: str = field(default="mlx", metadata=declare(
        Flag("--engine", "model runtime: torch runs transformers, vllm a vLLM "
             "deployment, llamacpp a .gguf file on llama.cpp", choices=lambda: ENGINES),
    ))
    #: The engine's loader keywords: from `ENGINE_FLAGS` on the command line.
    load_options: Mapping[str, Any] = field(default_factory=dict)
    max_batch: int | None = field(default=None, metadata=declare(
        Flag("--max-batch", "sequences decoded together", type=int, metavar="N"),
        range=at_least("int", 1),
        default_note="the engine's capacity, e.g. mlx-lm's BatchGenerator's 32; 1 for an "
        "engine without batched decoding",
    ))
    max_queue: int = field(default=DEFAULT_MAX_QUEUE, metadata=declare(
        Flag("--max-queue", "sequences that may wait for room in the batch; more get 429",
             type=int, metavar="N"),
        range=at_least("int", 0),
        proxy_default=DEFAULT_PROXY_MAX_QUEUE,
        default_note=f"{DEFAULT_MAX_QUEUE}; {DEFAULT_PROXY_MAX_QUEUE} with --upstream, whose "
        "own queue holds what its slots cannot run yet",
    ))
    prompt_cache_bytes: int | None = field(default=None, metadata=declare(
        Flag("--prompt-cache-bytes", "memory bound of the prompt cache shared across "
             "requests, for engines that have one", type=int, metavar="N"),
        range=at_least("int", 0),
        default_note="the engine's",
    ))
    client_timeout: float = field(default=DEFAULT_CLIENT_TIMEOUT, metadata=declare(
        Flag("--client-timeout", "drop a streaming client that leaves output unread this "
             "many seconds", type=float, metavar="S"),
        range=at_least("real", 0, strict=True),
    ))
    max_buffered: int = field(default=DEFAULT_MAX_BUFFERED, metadata=declare())  # no flag
    max_body_bytes: int = field(default=DEFAULT_MAX_BODY_BYTES, metadata=declare(
        Flag("--max-body-bytes", "largest accepted request body", type=int, metavar="N"),
        range=at_least("int", 1),
    ))
    temperature: float = field(default=0.0, metadata=declare(
        Flag("--temp", "temperature for requests that do not set one", type=float,
             metavar="T"),
        range=OPENAI_LIMITS["temp"],  # the range a request's temperature has
        default_note="0.0, as mlx_lm.server",
    ))
    api_key: str | None = field(default=None, metadata=declare(
        Flag("--api-key",
             "require 'Authorization: Bearer KEY' on /v1/*, /metrics and the tokenizer endpoints",
             metavar="KEY"),
        env="TOKENTRAIL_API_KEY",
        default_note="$TOKENTRAIL_API_KEY; none",
    ))
    allowed_hosts: Iterable[str] | None = field(default=None, metadata=declare(
        Flag("--allowed-host", "a Host name to serve besides the address, localhost and IP "
             "literals (repeatable; '*' allows any)", metavar="NAME", action="append"),
    ))
    reasoning: Any = field(default=None, metadata=declare(
        Flag("--reasoning-parser", "split chat replies into reasoning and content with a "
             "named format ({choices})", metavar="NAME", choices=_reasoning_parsers),
        Flag("--reasoning-markers", "split chat replies at these markers (START may be '': "
             "the reasoning then starts with the reply)", nargs=2, metavar=("START", "END")),
    ))
    tool_call_parser: str | None = field(default=None, metadata=declare(
        Flag("--tool-call-parser", "parse tool calls in this format ({choices})",
             metavar="NAME", choices=_tool_parsers),
        default_note="detected from the chat template",
    ))
    calibration: str | os.PathLike[str] | None = field(default=None, metadata=declare(
        Flag("--calibration", "a map fitted by `tokentrail calibrate`, or a built-in "
             "one's name (smollm2): adds confidence.calibrated and makes level follow it "
             "(refused for another model)",
             metavar="FILE"),
    ))

    def __post_init__(self) -> None:
        """Refuse settings no server can run with (ValueError naming the setting)."""
        _check_all(self)
        if self.reasoning is not None:
            from ..structure.reasoning import reasoning_format

            fmt = self.reasoning
            object.__setattr__(
                self, "reasoning", reasoning_format(tuple(fmt) if isinstance(fmt, list) else fmt)
            )
        if self.allowed_hosts is not None and not isinstance(self.allowed_hosts, tuple):
            object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))

    def updated(self, **changes: Any) -> ServerConfig:
        """A copy with `changes` (ServerConfig fields; TypeError names an unknown one)."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"unknown server setting(s): {', '.join(unknown)}")
        return replace(self, **changes) if changes else self

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, load_options: Mapping[str, Any] | None = None
    ) -> ServerConfig:
        """The settings `tokentrail serve`'s flags give (`load_options`: the engine's);
        `tokentrail.errors.UsageError` naming the flag for a value out of range."""
        given = values_from_args(cls, args)
        # The address served always passes the Host check, besides --allowed-host's names.
        given["allowed_hosts"] = (args.host, *(given["allowed_hosts"] or ()))
        try:
            return cls(**given, load_options=dict(load_options or {}))
        except ValueError as e:  # what the checks above leave: markers no format takes
            raise UsageError(str(e)) from None


@dataclass(frozen=True)
class ListenConfig:
    """How `tokentrail serve` listens and logs: the socket's `host` and `port` (0: any
    free port), uvicorn's `max_connections` (more get 503) and `keep_alive_timeout`, the
    `read_timeout` a client has to send a whole request, the `log_level`, and the
    `workers`: processes sharing the socket (`tokentrail.server.workers`; more than 1
    only in front of an upstream). Not part of the app: an app from `create_app` runs
    under whatever ASGI server it is given."""

    host: str = field(default="127.0.0.1", metadata=declare(Flag("--host", "address to listen on")))
    port: int = field(default=8080, metadata=declare(
        Flag("--port", "port to listen on (0: any free port)", type=int),
        range=Range("", "int", 0, 65535, note="0: any free port"),
    ))
    max_connections: int = field(default=DEFAULT_MAX_CONNECTIONS, metadata=declare(
        Flag("--max-connections", "concurrent connections and requests; more get 503",
             type=int, metavar="N"),
        range=at_least("int", 1),
    ))
    read_timeout: float = field(default=DEFAULT_READ_TIMEOUT, metadata=declare(
        Flag("--read-timeout", "seconds a client has to send a whole request, headers and "
             "body", type=float, metavar="S"),
        range=at_least("real", 0, strict=True),
    ))
    keep_alive_timeout: float = field(default=DEFAULT_KEEP_ALIVE, metadata=declare(
        Flag("--keep-alive-timeout", "seconds an idle connection stays open", type=float,
             metavar="S"),
        range=at_least("real", 0, strict=True),
    ))
    log_level: str = field(default="info", metadata=declare(
        Flag("--log-level", "how much to log", choices=lambda: LOG_LEVELS),
    ))
    workers: int = field(default=1, metadata=declare(
        Flag("--workers", "processes serving requests on the one socket, each with its own "
             "event loop: for --upstream, whose cost is per token in this process ('auto': "
             "the usable cores); an engine run here keeps its model in one process and takes "
             "1 only", type=worker_count, metavar="N"),
        range=at_least("int", 1),
    ))

    def __post_init__(self) -> None:
        """Refuse values out of range (ValueError naming the setting)."""
        _check_all(self)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ListenConfig:
        """The values `tokentrail serve`'s flags give; UsageError naming the flag for a
        value out of range."""
        return cls(**values_from_args(cls, args))


def _check_all(config: Any) -> None:
    """Check each of `config`'s settings against its range, keeping the checked value
    (an int or float as the range says); ValueError naming the first setting out of it."""
    for s in settings_of(type(config)):
        value = getattr(config, s.name)
        checked = s.check(value)
        if checked is not value:
            object.__setattr__(config, s.name, checked)
