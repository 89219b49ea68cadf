"""`ServerConfig`: the server's settings, built once (from `tokentrail serve`'s flags or
`create_app`'s keywords) and handed to the app and the `Scheduler` as one object.

This module imports no server dependency, so the `serve` parser loads without them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..batch import DEFAULT_MAX_BATCH

__all__ = [
    "DEFAULT_CLIENT_TIMEOUT",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_BUFFERED",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_PROXY_MAX_QUEUE",
    "Loader",
    "ServerConfig",
]

#: What loads a model: a function returning (model, tokenizer), run on the loop thread.
Loader = Callable[[], tuple[Any, Any]]

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

    model_path: str | os.PathLike[str] | None = None
    model_name: str | None = None
    engine: str = "mlx"
    load_options: Mapping[str, Any] = field(default_factory=dict)
    max_batch: int | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    prompt_cache_bytes: int | None = None
    client_timeout: float = DEFAULT_CLIENT_TIMEOUT
    max_buffered: int = DEFAULT_MAX_BUFFERED
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    temperature: float = 0.0
    api_key: str | None = None
    allowed_hosts: Iterable[str] | None = None
    reasoning: Any = None
    tool_call_parser: str | None = None
    calibration: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        """Refuse settings no server can run with (ValueError naming the setting)."""
        from ..sampling import OPENAI_LIMITS, check_value

        problems = [
            (self.max_queue >= 0, f"max_queue must be >= 0, got {self.max_queue}"),
            (self.max_batch is None or self.max_batch >= 1,
             f"max_batch must be >= 1 or None (the engine's capacity), got {self.max_batch}"),
            (self.max_body_bytes >= 1, f"max_body_bytes must be >= 1, got {self.max_body_bytes}"),
            (self.client_timeout > 0,
             f"client_timeout must be > 0 seconds, got {self.client_timeout}"),
            (self.prompt_cache_bytes is None or self.prompt_cache_bytes >= 0,
             f"prompt_cache_bytes must be >= 0, got {self.prompt_cache_bytes}"),
        ]
        for ok, message in problems:
            if not ok:
                raise ValueError(message)
        check_value("temp", self.temperature, OPENAI_LIMITS, label="temperature")
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
        """The settings `tokentrail serve`'s flags give (`load_options`: the engine's)."""
        given = {name: getattr(args, flag) for name, flag in _FLAGS.items()}
        if given["max_queue"] is None:  # the flag's default depends on what is served
            proxy = getattr(args, "upstream", None)
            given["max_queue"] = DEFAULT_PROXY_MAX_QUEUE if proxy else DEFAULT_MAX_QUEUE
        parser = getattr(args, "reasoning_parser", None)
        markers = getattr(args, "reasoning_markers", None)
        if parser is not None and markers is not None:
            raise ValueError("give --reasoning-parser or --reasoning-markers, not both")
        return cls(
            **given,
            reasoning=parser if markers is None else tuple(markers),
            load_options=dict(load_options or {}),
            allowed_hosts=(args.host, *args.allowed_host),
        )


#: ServerConfig field -> the `tokentrail serve` flag (argparse dest) that sets it.
_FLAGS = {
    "model_path": "model",
    "model_name": "model_name",
    "engine": "engine",
    "max_batch": "max_batch",
    "max_queue": "max_queue",
    "prompt_cache_bytes": "prompt_cache_bytes",
    "client_timeout": "client_timeout",
    "max_body_bytes": "max_body_bytes",
    "temperature": "temp",
    "api_key": "api_key",
    "tool_call_parser": "tool_call_parser",
    "calibration": "calibration",
}
