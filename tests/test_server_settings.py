"""`tokentrail serve`'s settings, declared once (`tokentrail.server.settings`): every flag
`serve --help` lists maps to a `ServerConfig` or `ListenConfig` field, an engine
loader's keyword or a proxy parameter; each range check fires, naming the flag on the
command line (exit 2, one line) and the setting in the library (ValueError), with the
same words. Parametrised over the declarations, so a new setting is tested by declaring
it once.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokentrail.cli import build_parser
from tokentrail.engines import ENGINES
from tokentrail.errors import UsageError
from tokentrail.server import ServerConfig
from tokentrail.server.config import (
    DEFAULT_PROXY_MAX_QUEUE,
    ENGINE_FLAGS,
    ENGINE_OPTIONS,
    ListenConfig,
    engine_options,
)
from tokentrail.server.proxy import create_upstream_app
from tokentrail.server.settings import Setting, settings_of

REPO = Path(__file__).resolve().parents[1]
SERVER_DOC = (REPO / "docs" / "server.md").read_text()

#: Every settings class `serve` builds from its flags, and its settings.
DECLARED: list[tuple[type, Setting]] = [
    (cls, s) for cls in (ServerConfig, ListenConfig) for s in settings_of(cls)
]
RANGED = [(cls, s) for cls, s in DECLARED if s.range is not None and s.flags]
#: Flags every `tokentrail` subcommand has.
COMMON_FLAGS = {"--help", "--verbose"}
#: The proxy's flags (`server/proxy.py`) -> `create_upstream_app`'s parameter they fill.
UPSTREAM_FLAGS = {
    "--upstream": "url",
    "--tokenizer": "tokenizer",
    "--upstream-api-key": "upstream_api_key",
    "--upstream-model": "upstream_model",
    "--upstream-dialect": "dialect",
    "--upstream-timeout": "timeout",
    "--upstream-chat": "upstream_chat",
}


def _help_flags() -> set[str]:
    """The flags `tokentrail serve --help` lists, read from its text."""
    r = subprocess.run(
        [sys.executable, "-m", "tokentrail", "serve", "--help"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
    )
    assert r.returncode == 0, r.stderr
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", r.stdout))


def _loader_keywords(engine: str) -> set[str]:
    """The keyword-only parameters of `engine`'s `load`, read from its source (importing
    it would need torch, vLLM or llama.cpp)."""
    spec = importlib.util.find_spec(ENGINES[engine])
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    load = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "load"
    )
    return {a.arg for a in load.args.kwonlyargs}


def _cli_error(*args: str) -> tuple[int, list[str]]:
    """`tokentrail serve ARGS`'s exit status and stderr lines (a bad flag exits before
    anything loads or binds; the timeout turns a wrongly accepted one into a failure)."""
    r = subprocess.run(
        [sys.executable, "-m", "tokentrail", "serve", "--port", "0", *args],
        capture_output=True, text=True, timeout=120,
    )
    return r.returncode, r.stderr.splitlines()


def _out_of_range(s: Setting) -> list[Any]:
    """Values just outside `s`'s range, as its flag would parse them."""
    r = s.range
    assert r is not None
    kind = int if r.kind == "int" else float
    bad = []
    if r.lo is not None:
        bad.append(kind(r.lo) if r.lo_open else kind(r.lo - (1 if kind is int else 0.5)))
    if r.hi is not None:
        bad.append(kind(r.hi + 1))
    return bad


def test_every_help_flag_maps_to_a_setting_an_engine_keyword_or_a_proxy_parameter() -> None:
    listed = _help_flags()
    setting_flags = {f.name: (cls, s) for cls, s in DECLARED for f in s.flags}
    engine_flags = {f.name: f for f in ENGINE_FLAGS}
    upstream = set(inspect.signature(create_upstream_app).parameters)
    for flag in sorted(listed - COMMON_FLAGS):
        if flag in setting_flags:
            cls, s = setting_flags[flag]
            assert s.name in {f.name for f in fields(cls)}, flag
        elif flag in engine_flags:
            f = engine_flags[flag]
            assert f.engines, flag
            for engine in f.engines:  # the loader takes it, and --engine lists it
                assert f.dest in _loader_keywords(engine), (flag, engine)
                assert f.dest in ENGINE_OPTIONS[engine], (flag, engine)
            assert f"`{flag}" in SERVER_DOC, f"{flag} is not in docs/server.md"
        else:
            assert UPSTREAM_FLAGS.get(flag) in upstream, f"{flag} maps to nothing"
    declared = set(setting_flags) | set(engine_flags) | set(UPSTREAM_FLAGS)
    assert declared <= listed, f"declared but not in --help: {sorted(declared - listed)}"
    assert set(ENGINE_OPTIONS) == set(ENGINES)


def test_every_config_field_is_declared_and_every_flag_documented() -> None:
    """No ServerConfig field escapes the declarations (but `load_options`, which the
    engine flags fill); each setting's flag is in docs/server.md's table."""
    declared = {s.name for s in settings_of(ServerConfig)}
    assert {f.name for f in fields(ServerConfig)} - declared == {"load_options"}
    assert {f.name for f in fields(ListenConfig)} == {s.name for s in settings_of(ListenConfig)}
    for _, s in DECLARED:
        for f in s.flags:
            assert f"`{f.name}" in SERVER_DOC, f"{f.name} is not in docs/server.md"


@pytest.mark.parametrize(
    ("cls", "s", "bad"),
    [(cls, s, bad) for cls, s in RANGED for bad in _out_of_range(s)],
    ids=lambda v: v.name if isinstance(v, Setting) else None,
)
def test_each_limit_names_the_flag_on_the_cli_and_the_setting_in_the_library(
    cls: type, s: Setting, bad: Any
) -> None:
    flag = s.flags[0].name
    with pytest.raises(ValueError, match=rf"^{s.name} must be ") as refused:
        cls(**{s.name: bad})
    code, lines = _cli_error(f"{flag}={bad}")
    assert code == 2 and len(lines) == 1, lines
    # The same words, but for whom they name.
    assert lines[0] == f"tokentrail serve: error: {flag}{str(refused.value)[len(s.name):]}"


@pytest.mark.parametrize(("args", "needle"), [
    (["--reasoning-parser", "qwen3", "--reasoning-markers", "<a>", "</a>"],
     "give --reasoning-parser or --reasoning-markers, not both"),
    (["--reasoning-markers", "<think>", ""], "end marker is empty"),
    *[([f.name, "1"], f"{f.name} does not apply to --engine mlx")
      for f in ENGINE_FLAGS[:1] + ENGINE_FLAGS[-1:]],
    (["--engine", "torch", "--n-ctx", "8"], "--n-ctx does not apply to --engine torch"),
])
def test_flags_that_conflict_exit_2_with_one_line(args: list[str], needle: str) -> None:
    code, lines = _cli_error(*args)
    assert code == 2 and len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize("flag", ENGINE_FLAGS, ids=lambda f: f.name)
def test_engine_flags_go_to_their_engines_only(flag: Any) -> None:
    for engine in ENGINE_OPTIONS:
        given = next(iter(flag.choices())) if flag.choices is not None else "1"
        args = build_parser().parse_args(["serve", "--engine", engine, flag.name, given])
        if engine in flag.engines:
            value = flag.type(given) if flag.type is not None else given
            # with what serve gives this engine's loader for the flags left out
            serve_defaults = {
                f.dest: f.serve_default
                for f in ENGINE_FLAGS
                if f.serve_default is not None and engine in f.engines
            }
            assert engine_options(args) == {**serve_defaults, flag.dest: value}
        else:
            with pytest.raises(UsageError, match=re.escape(flag.name)):
                engine_options(args)


def test_no_flags_give_the_library_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` with no flags runs with `ServerConfig()`'s and `ListenConfig()`'s values
    (the address served is an allowed host; the API key may come from the environment);
    `--upstream` changes the queue's default only."""
    monkeypatch.delenv("TOKENTRAIL_API_KEY", raising=False)
    args = build_parser().parse_args(["serve"])
    assert ListenConfig.from_args(args) == ListenConfig()
    assert ServerConfig.from_args(args) == ServerConfig(allowed_hosts=["127.0.0.1"])
    proxy = build_parser().parse_args(["serve", "--upstream", "http://x", "--tokenizer", "t"])
    assert ServerConfig.from_args(proxy) == ServerConfig(
        allowed_hosts=["127.0.0.1"], max_queue=DEFAULT_PROXY_MAX_QUEUE
    )
    given = build_parser().parse_args(["serve", "--upstream", "http://x", "--max-queue", "3"])
    assert ServerConfig.from_args(given).max_queue == 3
    monkeypatch.setenv("TOKENTRAIL_API_KEY", "from-env")
    assert ServerConfig.from_args(build_parser().parse_args(["serve"])).api_key == "from-env"


def _valid(cls: type, s: Setting) -> tuple[list[str], Any]:
    """A command line giving `s` a value that is not its default, and that value as the
    settings object holds it."""
    flag = s.flags[-1]
    if flag.nargs:
        words = [f"<{i}>" for i in range(flag.nargs)]
        return [flag.name, *words], cls(**{s.name: tuple(words)}).__getattribute__(s.name)
    if flag.choices is not None:
        word = [c for c in flag.choices() if c != s.default][-1]
    elif s.range is not None:  # a count or a duration (--workers also takes "auto")
        kind = int if s.range.kind == "int" else float
        word = str(kind((s.range.lo or 0) + 1))
    else:
        word = "name.example"
    value = flag.type(word) if flag.type else word
    if flag.action == "append":  # the address served comes first: checked on its own
        return [flag.name, word], None
    return [flag.name, word], cls(**{s.name: value}).__getattribute__(s.name)


def test_every_flag_sets_its_field() -> None:
    """One command line with every declared flag given: each field holds its value."""
    words: list[str] = []
    expected: dict[tuple[type, str], Any] = {}
    for cls, s in DECLARED:
        if s.flags:
            line, value = _valid(cls, s)
            words += line
            expected[cls, s.name] = value
    args = build_parser().parse_args(["serve", *words])
    built = {ServerConfig: ServerConfig.from_args(args, {"n_ctx": 8}),
             ListenConfig: ListenConfig.from_args(args)}
    for (cls, name), value in expected.items():
        if value is not None:
            assert getattr(built[cls], name) == value, name
    host = built[ListenConfig].host
    assert host != "127.0.0.1" and built[ServerConfig].allowed_hosts == (host, "name.example")
    assert built[ServerConfig].load_options == {"n_ctx": 8}


def _value(s: Setting) -> st.SearchStrategy[Any]:
    r = s.range
    assert r is not None
    lo = -10 if r.lo is None else r.lo - 10
    hi = (r.hi if r.hi is not None else r.lo + 10) + 10
    if r.kind == "int":
        return st.integers(int(lo), int(hi))
    return st.floats(lo, hi, allow_nan=False) | st.sampled_from([r.lo, r.hi or r.lo])


@pytest.mark.parametrize(("cls", "s"), RANGED, ids=lambda v: getattr(v, "name", None))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_cli_and_the_library_accept_the_same_values(
    cls: type, s: Setting, data: st.DataObject
) -> None:
    """Whatever the value, the flag and the keyword agree: both take it (and hold the
    same value), or both refuse it in the same words but for the name."""
    value = data.draw(_value(s))
    flag = s.flags[0]
    args = build_parser().parse_args(["serve", f"{flag.name}={value!r}"])
    try:
        library = getattr(cls(**{s.name: flag.type(repr(value))}), s.name)  # type: ignore[misc]
    except ValueError as e:
        with pytest.raises(UsageError) as cli:
            cls.from_args(args)  # type: ignore[attr-defined]
        assert str(cli.value) == flag.name + str(e)[len(s.name):]
    else:
        assert getattr(cls.from_args(args), s.name) == library  # type: ignore[attr-defined]


def test_config_keeps_its_keyword_constructor_and_updates() -> None:
    config = ServerConfig(max_batch=4, max_queue=0, temperature=1, reasoning=["<t>", "</t>"])
    assert (config.max_batch, config.max_queue, config.temperature) == (4, 0, 1.0)
    assert config.reasoning is not None and config.reasoning.end == ("</t>",)
    assert config.updated(max_queue=2).max_queue == 2
    with pytest.raises(TypeError, match="unknown server setting"):
        config.updated(max_queu=2)
    with pytest.raises(ValueError, match=r"^max_queue must be an int"):
        ServerConfig(max_queue="3")  # type: ignore[arg-type]


#: The stable interface, pinned: each limit flag's least accepted value, and its default.
STABLE_LIMITS = {
    "--max-batch": (1, None),
    "--max-queue": (0, 16),  # 1024 with --upstream: test_no_flags_give_the_library_defaults
    "--prompt-cache-bytes": (0, None),
    "--client-timeout": (1e-9, 30.0),
    "--max-body-bytes": (1, 1 << 20),
    "--temp": (0.0, 0.0),
    "--port": (0, 8080),
    "--max-connections": (1, 256),
    "--read-timeout": (1e-9, 10.0),
    "--keep-alive-timeout": (1e-9, 5.0),
    "--workers": (1, 1),
}


def test_the_limits_and_defaults_stay_as_they_were() -> None:
    ranged = {s.flags[0].name: (cls, s) for cls, s in RANGED}
    assert set(ranged) == set(STABLE_LIMITS)
    for flag, (least, default) in STABLE_LIMITS.items():
        cls, s = ranged[flag]
        assert getattr(cls(), s.name) == default, flag
        assert getattr(cls(**{s.name: least}), s.name) == least, flag
        below = least - 1 if isinstance(least, int) else (0.0 if least > 0 else least - 0.5)
        with pytest.raises(ValueError, match=f"^{s.name} must be "):
            cls(**{s.name: below})
    with pytest.raises(ValueError, match=r"^temperature must be in"):
        ServerConfig(temperature=2.5)
    with pytest.raises(ValueError, match=r"^port must be between 0 and 65535"):
        ListenConfig(port=65536)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.host, defaults.engine, defaults.log_level) == ("127.0.0.1", "mlx", "info")
