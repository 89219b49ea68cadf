"""A server setting declared once: a dataclass field whose metadata names the
`tokentrail serve` flag(s) that set it and the range its value must lie in.

From that one declaration (`declare`) come the flag (name, type, default, metavar,
help: `add_flags`), the check (`Setting.check`: a ValueError naming the setting from
the library, a `UsageError` naming the flag from the command line) and the value the
parsed flags give (`values_from_args`). `ServerConfig` and `ListenConfig` (`config.py`)
are declared this way, as transformers' `HfArgumentParser` builds flags from dataclass
fields; kept to argparse and dataclasses so `tokentrail serve --help` loads without the
server extra.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, fields
from functools import cache
from typing import Any, Literal

from ..errors import SamplingError, UsageError
from ..sampling import Range

__all__ = ["Flag", "Setting", "add_flags", "at_least", "declare", "settings_of", "values_from_args"]

#: The key under which `setting` leaves its declaration in a field's metadata.
_KEY = "tokentrail.setting"


@dataclass(frozen=True)
class Flag:
    """One `tokentrail serve` flag: its `name` ("--max-queue"), `help` (where
    ``{choices}`` is replaced by the choices), argparse's `type`, `metavar`, `nargs` and
    `action`, `choices` (a function giving them, called when the parser is built, so the
    modules that define them load only then) and, for an engine loader's flag, the
    `engines` that take it and `serve_default`, what serve gives their loader when the
    flag is left out (None: the loader's own default)."""

    name: str
    help: str = ""
    type: Callable[[str], Any] | None = None
    metavar: str | tuple[str, ...] | None = None
    choices: Callable[[], Iterable[str]] | None = None
    nargs: int | None = None
    action: Literal["append", "store_true"] | None = None
    engines: tuple[str, ...] = ()
    serve_default: Any = None

    @property
    def dest(self) -> str:
        """The argparse attribute the flag's value lands in ("--max-queue": max_queue)."""
        return self.name[2:].replace("-", "_")


@dataclass(frozen=True)
class Setting:
    """One setting of a settings dataclass: the field `name`, its `default`, the `flags`
    that set it (none: the library's only; several: at most one of them may be given),
    the `range` it is checked against (None: unchecked; a None value passes when the
    default is None, e.g. "the engine's capacity"), `proxy_default` (the default under
    ``serve --upstream``: the flag is then left None until `values_from_args`), `env` (an
    environment variable that gives the flag's default) and `default_note` (the default
    in words where the value alone would not say it)."""

    name: str
    default: Any
    flags: tuple[Flag, ...] = ()
    range: Range | None = None
    proxy_default: Any = None
    env: str | None = None
    default_note: str | None = None

    def flag_default(self) -> Any:
        """The default argparse gives the flag (read when the parser is built)."""
        if self.proxy_default is not None:
            return None  # settled by values_from_args, once --upstream is known
        if self.env is not None:
            return os.environ.get(self.env) or self.default
        return self.default

    def help(self, flag: Flag) -> str:
        """`flag`'s help with its choices and default filled in."""
        text = flag.help
        if flag.engines:
            engines = "/".join(flag.engines)
            text = f"{engines} engine{'s' if len(flag.engines) > 1 else ''}: {text}".rstrip(": ")
        if flag.choices is not None:
            text = text.replace("{choices}", ", ".join(flag.choices()))
        if self.default_note is not None:
            return f"{text} (default: {self.default_note})"
        if self.default is None or isinstance(self.default, bool | Mapping):
            return text
        shown = f"{self.default:g}" if isinstance(self.default, float) else self.default
        return f"{text} (default {shown})"

    def check(self, value: Any, label: str | None = None) -> Any:
        """`value` if it is in range (an int or float as the range's kind says), else
        ValueError naming `label` (default: the setting's name) and the range."""
        if self.range is None or (value is None and self.default is None):
            return value
        try:
            return self.range.check(value, label or self.name)
        except SamplingError as e:
            raise ValueError(str(e)) from None


def at_least(kind: Literal["int", "real"], least: float, *, strict: bool = False) -> Range:
    """The range of a count or a duration: `least` or more (more than `least` if
    `strict`)."""
    return Range("", kind, least, lo_open=strict)


def declare(
    *flags: Flag,
    range: Range | None = None,
    proxy_default: Any = None,
    env: str | None = None,
    default_note: str | None = None,
) -> dict[str, Any]:
    """A dataclass field's metadata declaring it a setting (see `Setting` for the
    arguments): ``x: int = field(default=1, metadata=declare(Flag("--x"), ...))``."""
    declared = {
        "flags": flags,
        "range": range,
        "proxy_default": proxy_default,
        "env": env,
        "default_note": default_note,
    }
    return {_KEY: declared}


@cache
def settings_of(cls: type) -> tuple[Setting, ...]:
    """The settings `cls` (a dataclass whose fields' metadata come from `declare`)
    declares, in field order."""
    found = []
    for f in fields(cls):
        if _KEY not in f.metadata:
            continue
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        found.append(Setting(f.name, default, **f.metadata[_KEY]))
    return tuple(found)


def add_flags(parser: Any, settings: Iterable[Setting]) -> None:
    """Add the flags of `settings` to `parser` (an argparse parser or argument group)."""
    for s in settings:
        for flag in s.flags:
            options: dict[str, Any] = {"default": s.flag_default(), "help": s.help(flag)}
            if flag.action is not None:
                options["action"] = flag.action
            for key in ("type", "metavar", "nargs"):
                if getattr(flag, key) is not None:
                    options[key] = getattr(flag, key)
            if flag.choices is not None:
                options["choices"] = list(flag.choices())
            parser.add_argument(flag.name, **options)


def values_from_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values `cls`'s flags were given in `args`, each checked against its range
    (a `UsageError` naming the flag), for the fields that have flags.

    A setting with several flags takes the one given (a list of values as a tuple) and
    refuses more than one; a setting with a `proxy_default` left out takes it under
    ``--upstream`` and the field's default otherwise.
    """
    values: dict[str, Any] = {}
    for s in settings_of(cls):
        if not s.flags:
            continue
        given = [(f, getattr(args, f.dest)) for f in s.flags if getattr(args, f.dest) is not None]
        if len(s.flags) == 1:
            flag, value = s.flags[0], getattr(args, s.flags[0].dest)
        elif len(given) > 1:
            raise UsageError(f"give {' or '.join(f.name for f, _ in given)}, not both")
        else:
            flag, value = given[0] if given else (s.flags[0], None)
            value = tuple(value) if isinstance(value, list) else value
        if value is None and s.proxy_default is not None:
            value = s.proxy_default if getattr(args, "upstream", None) else s.default
        try:
            values[s.name] = s.check(value, flag.name)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return values
