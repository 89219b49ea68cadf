"""The command line's one error contract: bad input exits with status 2 and one line
on stderr. Every subcommand (`align`, `generate`, `serve`, `realign`, `bench`, and
`python -m tokentrail.models`) builds its parser from `Parser` and reports through
`fail` or by raising `tokentrail.errors.UsageError`.

A leaf module: it imports nothing else from tokentrail but the errors.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from .errors import UsageError

__all__ = ["EXIT_USAGE", "Parser", "UsageError", "abort", "add_command", "fail", "one_line"]

#: The exit status for input the command cannot use.
EXIT_USAGE = 2


def one_line(message: object) -> str:
    """`message` with every run of whitespace (newlines included) folded to one space."""
    return " ".join(str(message).split())


class Parser(argparse.ArgumentParser):
    """argparse with the usage contract: a bad flag is one line on stderr and exit 2
    (argparse's own `error` prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {one_line(message)}\n")
        raise SystemExit(EXIT_USAGE)


def fail(message: object, prog: str = "tokentrail") -> int:
    """Print one line on stderr and return the usage-error status."""
    sys.stderr.write(f"{prog}: error: {one_line(message)}\n")
    return EXIT_USAGE


def abort(message: object, prog: str = "tokentrail") -> NoReturn:
    """`fail`, then exit: for code deep inside a command that cannot return a status."""
    raise SystemExit(fail(message, prog))


def add_command(subparsers: Any, name: str, summary: str, *description: str) -> Parser:
    """Add subcommand `name` to a `tokentrail` parser: `summary` is its line in
    `tokentrail --help`, `description` (joined with spaces) the text atop its own help."""
    parser: Parser = subparsers.add_parser(
        name, help=summary, description=" ".join(description) or None
    )
    return parser
