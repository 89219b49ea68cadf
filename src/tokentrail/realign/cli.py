"""`tokentrail realign`: realign a captured stream from the command line."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from ..segment import Segment
from .capture import read_chunks
from .core import Realigner
from .result import RealignError
from .wire import WIRE_NEG_INF


def _json_logprob(value: float | None) -> float | None:
    """A logprob as JSON can carry it: -inf as -9999.0 (OpenAI's rule), NaN and +inf as
    null."""
    if value is None or math.isnan(value):
        return None
    if math.isinf(value):
        return WIRE_NEG_INF if value < 0 else None
    return value


def segment_json(seg: Segment) -> dict[str, Any]:
    """A segment as the CLI prints it: JSON-safe (-inf logprobs as -9999.0, non-finite
    confidence figures as null)."""
    out = seg.to_dict()
    for t in out["tokens"]:
        if "logprob" in t:
            t["logprob"] = _json_logprob(t["logprob"])
        for a in t.get("top_logprobs") or ():
            a["logprob"] = _json_logprob(a["logprob"])
    try:
        conf = seg.confidence
    except (OverflowError, ValueError):
        conf = None
    if conf is not None:
        out["confidence"] = conf.to_dict()  # its non-finite figures are null already
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokentrail realign` to the CLI."""
    p = subparsers.add_parser(
        "realign",
        help="rebuild exact segments and token attribution from a captured stream",
        description=(
            "Read the chunks an OpenAI-compatible server streamed (JSON lines, or a raw "
            "SSE capture with 'data: ' lines) and print one JSON object per segment: its "
            "text, the tokens behind it and their confidence. Exit 0 when exact, 3 when "
            "the stream was lossy (some tokens could not be identified; their text is "
            "still printed, with 'refused') or its text differs from the content, and 2 "
            "on bad input."
        ),
    )
    p.add_argument("--tokenizer", required=True, help="tokenizer file or model folder")
    skip = p.add_mutually_exclusive_group()
    skip.add_argument(
        "--skip-special-tokens",
        dest="skip_special_tokens",
        action="store_const",
        const=True,
        default=None,
        help="special tokens add no text (default: follow the stream's content)",
    )
    skip.add_argument(
        "--keep-special-tokens",
        dest="skip_special_tokens",
        action="store_const",
        const=False,
        help="special tokens add their text",
    )
    p.add_argument("--choice", type=int, default=0, help="which choice to realign (default 0)")
    p.add_argument("input", nargs="?", default="-", help="capture file (default: stdin)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`tokentrail realign`: see `register`."""
    from ..usage import fail
    from ..vocab import TokenizerLoadError

    try:
        realigner = Realigner(args.tokenizer, args.skip_special_tokens, choice=args.choice)
    except (TokenizerLoadError, OSError, ValueError) as e:
        return fail(f"cannot load tokenizer {args.tokenizer}: {e}")
    except Exception as e:  # a tokenizer library rejecting a corrupt file
        return fail(f"cannot load tokenizer {args.tokenizer}: {type(e).__name__}: {e}")
    stream: TextIO
    try:
        stream = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        return fail(f"cannot read {args.input}: {e.strerror}")
    out = sys.stdout
    where = "stdin" if args.input == "-" else args.input
    seen = _Seen()
    try:
        with stream:
            for chunk in seen.watch(_chunks_of(stream, where)):
                for seg in realigner.feed(chunk):
                    out.write(json.dumps(segment_json(seg), ensure_ascii=False) + "\n")
            for seg in realigner.finish():
                out.write(json.dumps(segment_json(seg), ensure_ascii=False) + "\n")
    except RealignError as e:
        return fail(str(e))
    except UnicodeDecodeError as e:
        return fail(f"{where} is not UTF-8 text: {e.reason} at byte {e.start}")
    out.flush()
    if not seen.chunks:
        return fail(f"{where} is empty: no chunks to realign")
    result = realigner.result()
    if result.errors:
        return fail(result.errors[0])
    if seen.choices and args.choice not in seen.choices:
        shown = ", ".join(str(c) for c in sorted(seen.choices))
        return fail(f"the stream has no choice {args.choice} (its choices: {shown})")
    if result.exact:
        return 0
    sys.stderr.write(f"tokentrail: warning: {result.summary()}\n")
    return 3


class _Seen:
    """What the chunks held: how many, and which choice indices."""

    def __init__(self) -> None:
        self.chunks = 0
        self.choices: set[int] = set()

    def watch(self, chunks: Iterator[Any]) -> Iterator[Any]:
        for chunk in chunks:
            self.chunks += 1
            choices = chunk.get("choices") if isinstance(chunk, dict) else None
            if isinstance(choices, list):
                for k, ch in enumerate(choices):
                    if isinstance(ch, dict) and isinstance(ch.get("index", k), int):
                        self.choices.add(ch.get("index", k))
            yield chunk


def _chunks_of(stream: TextIO, where: str) -> Iterator[Any]:
    """JSON lines / SSE, or (when the first line is not JSON) one JSON document."""
    first = ""
    n = 0
    for n, line in enumerate(stream, 1):  # noqa: B007 (n is used after the loop)
        if line.strip():
            first = line
            break
    if not first:
        return
    try:
        head = list(read_chunks([first], where, n))
    except RealignError:
        doc = first + stream.read()
        try:
            whole = json.loads(doc)
        except json.JSONDecodeError:
            head = list(read_chunks([first], where, n))  # raises, naming the line
            return
        yield from (whole if isinstance(whole, list) else [whole])
        return
    yield from head
    yield from read_chunks(stream, where, n + 1)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tokentrail.realign ...`: the same as `tokentrail realign`."""
    from ..usage import Parser

    parser = Parser(prog="python -m tokentrail.realign")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    return int(run(parser.parse_args(["realign", *(argv or sys.argv[1:])])))
