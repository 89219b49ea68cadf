"""Command line: `tokentrail align | generate | serve | realign | check | calibrate | bench`.

Each command lives with the code it drives; this module only builds the parser. Errors
in input exit with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import re
import sys
import time
from collections.abc import Sequence

from .errors import UsageError
from .usage import Parser, add_command, fail

log = logging.getLogger(__name__)


# -- align -----------------------------------------------------------------------------

_ID_SPLIT = re.compile(r"[,\s]+")


def parse_ids(text: str, where: str) -> list[int]:
    """Ids separated by commas or whitespace; a non-integer is a UsageError naming it."""
    ids = []
    for part in _ID_SPLIT.split(text.strip()):
        if not part:
            continue
        try:
            ids.append(int(part))
        except ValueError:
            raise UsageError(f"{where}: {part!r} is not an integer token id") from None
    return ids


def _run_align(args: argparse.Namespace) -> int:
    from .align import Aligner
    from .vocab import TokenizerLoadError

    try:
        aligner = Aligner(
            args.tokenizer,
            skip_special_tokens=args.skip_special_tokens,
            reference=args.reference,
        )
    except (TokenizerLoadError, OSError, ValueError) as e:
        return fail(f"cannot load tokenizer {args.tokenizer}: {e}")
    except Exception as e:  # a tokenizer library rejecting a corrupt file
        return fail(f"cannot load tokenizer {args.tokenizer}: {type(e).__name__}: {e}")
    try:
        prompt: list[int] | None = None
        if args.prompt_ids is not None:
            prompt = parse_ids(args.prompt_ids, "--prompt-ids")
        elif args.prompt_text is not None:
            try:
                prompt = aligner.vocab.encode(args.prompt_text, add_special_tokens=True)
            except RuntimeError as e:
                return fail(f"--prompt-text: {e}")
        if prompt is not None:
            try:
                aligner.reset(prompt_ids=prompt)
            except (ValueError, TypeError) as e:
                return fail(f"--prompt-{'ids' if args.prompt_ids is not None else 'text'}: {e}")
        if args.text is not None:
            sequences = [(None, aligner.vocab.encode(args.text))]
        elif args.ids is not None:
            sequences = [(None, parse_ids(args.ids, "--ids"))]
        else:
            try:
                with open(args.ids_file, encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except OSError as e:
                return fail(f"cannot read --ids-file {args.ids_file}: {e.strerror}")
            sequences = [
                (n, parse_ids(line, f"{args.ids_file} line {n + 1}"))
                for n, line in enumerate(lines)
            ]
        for _, ids in sequences:  # validate everything before printing anything
            for i in ids:
                aligner.vocab.check_id(i)
    except UsageError as e:
        return fail(str(e))
    except (ValueError, TypeError) as e:
        return fail(str(e))
    out = sys.stdout
    for seq, ids in sequences:
        for segment in aligner.align(ids):
            obj = segment.to_dict()
            if seq is not None:
                obj = {"seq": seq, **obj}
            out.write(json.dumps(obj, ensure_ascii=False) + "\n")
    return 0


def _register_align(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "align",
        help="align token ids to text segments",
        description="Print one JSON object per segment: its text and the tokens behind it. "
        "With --prompt-ids or --prompt-text the ids continue that prompt and only the "
        "continuation's segments are printed; prompt tokens that carry a still-open tail "
        "of the prompt (half a character) appear in them with a negative index.",
    )
    p.add_argument("--tokenizer", required=True, help="tokenizer file or model folder")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", help="token ids, separated by commas or spaces")
    src.add_argument("--ids-file", help="file with one id sequence per line")
    src.add_argument("--text", help="text to encode with the tokenizer, then align")
    p.add_argument("--skip-special-tokens", action="store_true")
    ctx = p.add_mutually_exclusive_group()
    ctx.add_argument(
        "--prompt-ids",
        help="prompt token ids (commas or spaces): the ids continue this prompt, and only "
        "the continuation's segments are printed",
    )
    ctx.add_argument(
        "--prompt-text",
        help="prompt text, encoded with the special tokens the tokenizer adds by default "
        "(a BOS, for many); only the continuation's segments are printed",
    )
    p.add_argument(
        "--reference",
        choices=("auto", "llama.cpp", "transformers"),
        default="auto",
        help="whose decode the text equals: auto (the format's own library; llama.cpp for "
        "GGUF files), llama.cpp, or transformers (GGUF through transformers)",
    )
    p.set_defaults(func=_run_align)


# -- bench -----------------------------------------------------------------------------


def _run_bench(args: argparse.Namespace) -> int:
    from .align import Aligner
    from .vocab import TokenizerLoadError

    # Settings are checked before the tokenizer is loaded, so mistakes fail fast.
    if args.tokens < 1:
        return fail(f"--tokens must be at least 1, not {args.tokens}")
    if args.repeat < 1:
        return fail(f"--repeat must be at least 1, not {args.repeat}")
    try:
        aligner = Aligner(args.tokenizer)
    except (TokenizerLoadError, OSError, ValueError) as e:
        return fail(f"cannot load tokenizer {args.tokenizer}: {e}")
    if args.text_file:
        try:
            with open(args.text_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            return fail(f"cannot read --text-file {args.text_file}: {e.strerror}")
        except UnicodeDecodeError as e:
            return fail(f"--text-file {args.text_file} is not UTF-8 text: {e.reason}")
    else:
        import pydoc_data.topics

        text = "\n".join(pydoc_data.topics.topics.values())
    ids = aligner.vocab.encode(text)
    if not ids:
        return fail("the text encodes to no tokens")
    while len(ids) < args.tokens:
        ids = ids + ids
    ids = ids[: args.tokens]

    def text_only() -> None:
        push = aligner.push
        for i in ids:
            for seg in push(i):
                seg.text  # noqa: B018
        aligner.finish()

    def with_tokens() -> None:
        push = aligner.push
        for i in ids:
            for seg in push(i):
                seg.tokens  # noqa: B018
        aligner.finish()

    result: dict[str, object] = {"tokenizer": args.tokenizer, "tokens": len(ids)}
    for label, fn in (("text", text_only), ("text_and_tokens", with_tokens)):
        runs = []
        for _ in range(args.repeat):
            t0 = time.perf_counter_ns()
            fn()
            runs.append((time.perf_counter_ns() - t0) / 1000 / len(ids))
        runs.sort()
        result[f"us_per_token_median_{label}"] = round(runs[len(runs) // 2], 3)
    print(json.dumps(result))
    return 0


def _register_bench(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub, "bench", "measure the aligner's cost per token on a tokenizer",
        "Print the aligner's median microseconds per token on a fixed token sequence, reading",
        "each segment's text, then also its tokens (benchmarks/ compares detokenizers).",
    )
    p.add_argument("--tokenizer", required=True, metavar="PATH",
                   help="tokenizer file or model folder to measure")
    p.add_argument("--tokens", type=int, default=20000, metavar="N",
                   help="tokens per run; the text is repeated to reach N (default: 20000)")
    p.add_argument("--repeat", type=int, default=5, metavar="R",
                   help="timed runs per measurement, at least 1; the median is "
                   "reported (default: 5)")
    p.add_argument("--text-file", metavar="FILE",
                   help="UTF-8 text to encode into the token sequence "
                   "(default: Python's bundled documentation, pydoc_data)")
    p.set_defaults(func=_run_bench)


# -- entry point -----------------------------------------------------------------------

# Modules that add their own sub-command through `register(subparsers)`.
_PLUGINS = (
    "tokentrail.generate_cli",
    "tokentrail.server",
    "tokentrail.realign",
    "tokentrail.check",
    "tokentrail.calibrate",
)


_VERBOSE_HELP = "log progress (INFO level) to stderr"


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    """Accept -v/--verbose after the sub-command too (`tokentrail generate -v ...`).

    The sub-command's copy has no default of its own (SUPPRESS), so it never resets a
    `-v` given before the sub-command. A sub-command that already defines -v keeps it.
    """
    try:
        parser.add_argument("-v", "--verbose", action="store_true",
                            default=argparse.SUPPRESS, help=_VERBOSE_HELP)
    except argparse.ArgumentError:
        log.debug("%s defines its own -v/--verbose", parser.prog)


def build_parser() -> argparse.ArgumentParser:
    """The `tokentrail` parser with every sub-command whose module imports."""
    from . import __version__

    parser = Parser(
        prog="tokentrail",
        description="Text from language models where every piece carries the exact tokens, "
        "logprobs and alternatives that produced it.",
        epilog="`tokentrail COMMAND --help` explains each command's options. Bad input exits "
        "with status 2 and one line on stderr.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    parser.add_argument("--version", action="version", version=f"tokentrail {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    _register_align(sub)
    for name in _PLUGINS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.register(sub)
    _register_bench(sub)
    for subparser in sub.choices.values():
        _add_verbose(subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
