"""`tokentrail check URL`: what an OpenAI-compatible server really streams."""

from __future__ import annotations

import argparse
import json
import sys

from ..usage import add_command, fail

#: Exit status when the server breaks its own contract.
EXIT_BROKEN = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokentrail check` to the CLI."""
    p = add_command(
        subparsers, "check", "report what an OpenAI-compatible server streams, and whether "
        "it keeps its own contract",
        "Send a fixed set of probes (multi-byte characters, emoji, a stop string that ends",
        "mid-token, the end-of-turn token, a long seeded output, n > 1, bad requests) and",
        "report the server's capabilities, the contract checks and the dialect `serve",
        "--upstream` would use. Exit 0 when it keeps its contract, 1 when it breaks it, 2 on",
        "bad usage or an unreachable server.",
    )  # fmt: skip
    p.add_argument("url", help="the server's base URL (with or without /v1)")
    p.add_argument("--model", metavar="M", help="model to ask for (default: the first of "
                   "/v1/models)")  # fmt: skip
    p.add_argument("--tokenizer", metavar="T", help="the model's tokenizer (file or folder): "
                   "realign every stream with it too")  # fmt: skip
    p.add_argument("--api-key", metavar="K", help="sent as a bearer token")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quick", action="store_true", help="a few short probes only (what the "
                   "proxy runs at startup)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds per request (default 120)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`tokentrail check`: see `register`."""
    from ..errors import UpstreamError
    from .probe import Checker
    from .report import render

    if not args.url.startswith(("http://", "https://")):
        return fail(f"check: the URL must be http(s), got {args.url!r}")
    if args.timeout <= 0:
        return fail(f"check: --timeout must be > 0, got {args.timeout}")
    tokenizer = None
    if args.tokenizer:
        from ..vocab import TokenizerLoadError, load_vocab

        try:
            tokenizer = load_vocab(args.tokenizer)
        except (TokenizerLoadError, OSError, ValueError) as e:
            return fail(f"check: cannot load tokenizer {args.tokenizer}: {e}")
    checker = Checker(args.url, model=args.model, api_key=args.api_key, tokenizer=tokenizer,
                      timeout=args.timeout, quick=args.quick)  # fmt: skip
    try:
        report = checker.run()
    except UpstreamError as e:
        return fail(f"check: {e}")
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(), ensure_ascii=False, indent=2) + "\n")
    else:
        from rich.console import Console

        render(report, Console(width=max(100, Console().width)))
    return 0 if report.ok else EXIT_BROKEN
