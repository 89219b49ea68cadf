"""`tokentrail generate`: stream text coloured by the model's confidence, or JSON lines.

In a terminal each segment is coloured by its confidence level
(`tokentrail.segment.confidence_level`, the same levels the page shades: bright green
and green for sure, yellow for hesitant, orange and red for unsure) and a summary
lists the least confident segments with the alternatives the model weighed. With
`--json`, every response is one JSON object per line, for scripts. Like
`mlx_lm.generate`, the prompt goes through the model's chat template when it has one
(`--no-chat` sends it as plain text). Bad input exits with status 2 and one line on
stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from typing import Any, NoReturn

from .byte_text import show_bytes
from .engines import ENGINES
from .segment import Alternative
from .usage import abort, add_command

log = logging.getLogger(__name__)

#: Alternatives per token in terminal mode when --top-logprobs is not given.
DEFAULT_TERMINAL_TOP_LOGPROBS = 5
#: Segment probability thresholds for green and yellow; below the second is red.
#: Rich styles for confidence levels 0..4 (`tokentrail.segment.CONFIDENCE_LEVELS`).
LEVEL_STYLES = ("red", "dark_orange", "yellow", "green", "bright_green")
_PROG = "tokentrail generate"


#: The sampling flags: (flag, type, default, metavar, help).
_SAMPLING_FLAGS: tuple[tuple[str, Any, Any, str, str], ...] = (
    ("--temp", float, 0.0, "T", "sampling temperature; 0 is greedy (default: 0)"),
    ("--top-p", float, 1.0, "P", "nucleus sampling threshold in (0, 1] (default: 1)"),
    ("--top-k", int, 0, "K", "sample from the K most likely tokens; 0 is off (default: 0)"),
    ("--min-p", float, 0.0, "P",
     "drop tokens below P times the likeliest's probability; 0 is off (default: 0)"),
    ("--repetition-penalty", float, None, "R",
     "divide the logits of tokens already in the context by R (> 0; default: none)"),
    ("--presence-penalty", float, 0.0, "X",
     "subtract X from the logits of tokens already generated, -2..2 (OpenAI's; default: 0)"),
    ("--frequency-penalty", float, 0.0, "X",
     "subtract X times its count from each generated token's logit, -2..2 (OpenAI's; "
     "default: 0)"),
    ("--seed", int, None, "S", "random seed for reproducible sampling"),
)  # fmt: skip


def _add_sampling(p: argparse.ArgumentParser) -> None:
    for flag, kind, default, metavar, text in _SAMPLING_FLAGS:
        p.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `generate` command to the tokentrail CLI."""
    p = add_command(
        subparsers, "generate", "generate text with per-segment tokens, logprobs and confidence",
        "Generate from PROMPT (default: stdin), through the model's chat template when it has",
        "one (--no-chat: plain text); the text is coloured by confidence, then summarised.",
        "--json prints one JSON object per generated token.",
    )
    p.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt (default: stdin)")
    p.add_argument(
        "--model", metavar="PATH", default=None,
        help="model folder in Hugging Face layout, a .gguf file, or a named model "
        "(smollm2) (default: the built-in demo model)",
    )
    p.add_argument("--engine", default="mlx", choices=tuple(sorted(ENGINES)),
                   help="model runtime (default: mlx; llamacpp runs a .gguf file)")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N",
                   help="most tokens to generate; -1 for no limit (default: 256)")
    _add_sampling(p)
    p.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="stop when the text contains STR (repeat for several)")
    p.add_argument(
        "--top-logprobs", type=int, default=None, metavar="K",
        help=f"alternatives reported per token, 0..20 (default: "
        f"{DEFAULT_TERMINAL_TOP_LOGPROBS} in a terminal, 0 with --json)",
    )
    chat = p.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat", dest="chat", action="store_const", const="on", default="auto",
        help="send PROMPT as a user message through the model's chat template; an error "
        "when the model has none (default: do so whenever the model has a chat template, "
        "as mlx_lm.generate does)",
    )
    chat.add_argument(
        "--no-chat", "--raw", "--ignore-chat-template", dest="chat", action="store_const",
        const="off", help="send PROMPT as plain text, without the chat template",
    )
    p.add_argument(
        "--system", "--system-prompt", metavar="TEXT", default=None,
        help="system message placed before PROMPT in the chat template (needs one)",
    )
    reasoning = p.add_mutually_exclusive_group()
    reasoning.add_argument(
        "--reasoning-parser", metavar="NAME", default=None,
        help="split the reply into reasoning and content with a named parser "
        "(deepseek_r1, qwen3, mistral, granite)",
    )
    reasoning.add_argument(
        "--reasoning-markers", nargs=2, metavar=("START", "END"), default=None,
        help="split the reply at these markers; START may be '' (the reasoning then "
        "starts with the reply)",
    )
    p.add_argument("--fields", action="store_true",
                   help="when the content is JSON, list its fields with their tokens, "
                   "confidence and alternatives")
    constrain = p.add_mutually_exclusive_group()
    constrain.add_argument(
        "--json-schema", metavar="FILE", default=None,
        help="constrain the reply to JSON matching the schema in FILE (llguidance); "
        "turns --fields on",
    )
    constrain.add_argument("--regex", metavar="R", default=None,
                           help="constrain the reply to match the regular expression R")
    constrain.add_argument("--choice", metavar="A,B,...", default=None,
                           help="constrain the reply to one of these comma-separated strings")
    p.add_argument("--json", action="store_true", help="print one JSON object per token")
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="a map from `tokentrail calibrate --fit`, or a built-in one's name "
                   "(smollm2): adds confidence.calibrated and colours by it (refused for "
                   "another model)")
    p.set_defaults(func=run, chat="auto")


def _fail(message: str) -> NoReturn:
    abort(message, _PROG)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return str(args.prompt)
    if sys.stdin is None or sys.stdin.isatty():
        _fail("no prompt: give PROMPT as an argument or pipe it on stdin")
    return sys.stdin.read().rstrip("\n")


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags as `make_params` and `stream_generate` keywords."""
    return {
        "temp": args.temp, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty, "seed": args.seed,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run `tokentrail generate`; return the exit status."""
    from .sampling import check_max_tokens, make_params
    from .stops import StopMatcher
    from .vocab import TokenizerLoadError

    top = args.top_logprobs
    if top is None:
        top = 0 if args.json else DEFAULT_TERMINAL_TOP_LOGPROBS
    try:
        # Settings are checked before the (slow) model load, so mistakes fail fast.
        check_max_tokens(args.max_tokens)
        make_params(**_sampling(args), top_logprobs=top)
        if args.stop:
            StopMatcher(args.stop)
    except (ValueError, TypeError) as e:
        _fail(str(e))
    if args.system is not None and args.chat == "off":
        _fail("--system needs the chat template, which --no-chat turns off")
    reasoning = _reasoning(args)
    constraint = _constraint(args)
    prompt_text = _read_prompt(args)
    try:
        from .generate import load, stream_generate

        t0 = time.perf_counter()
        model, tokenizer = load(args.model, engine=args.engine)
        templated = has_chat_template(tokenizer)
        log.info(
            "loaded %s with the %s engine in %.2f s (chat template: %s)",
            args.model or "the demo model", args.engine, time.perf_counter() - t0,
            "yes" if templated else "no",
        )
        prompt = _prompt(args, prompt_text, templated)
        responses = stream_generate(
            model, tokenizer, prompt, max_tokens=args.max_tokens, **_sampling(args),
            stop=args.stop, top_logprobs=top, reasoning=reasoning, fields=wants_fields(args),
            **constraint, calibration=args.calibration,
        )
    except (FileNotFoundError, ValueError, TypeError, TokenizerLoadError, ImportError) as e:
        _fail(str(e))
    try:
        if args.json:
            for r in responses:
                sys.stdout.write(json.dumps(r.to_dict()) + "\n")
                sys.stdout.flush()
            return 0
        return show(responses)
    except KeyboardInterrupt:
        responses.close()
        return 130
    except BrokenPipeError:
        return 0


def _reasoning(args: argparse.Namespace) -> Any:
    """The checked --reasoning-parser / --reasoning-markers (None: neither)."""
    from .structure import reasoning_format

    given = args.reasoning_parser
    if args.reasoning_markers is not None:
        given = tuple(args.reasoning_markers)
    if given is None:
        return None
    try:
        return reasoning_format(given)
    except ValueError as e:
        _fail(str(e))


#: Options that constrain the output to JSON, and so turn --fields on.
CONSTRAINT_OPTIONS = ("json_schema",)


def wants_fields(args: argparse.Namespace) -> bool:
    """Whether to find JSON fields: --fields, or a JSON constraint given."""
    return bool(args.fields) or any(
        getattr(args, name, None) is not None for name in CONSTRAINT_OPTIONS
    )


def _constraint(args: argparse.Namespace) -> dict[str, Any]:
    """`stream_generate`'s constraint keyword from --json-schema / --regex / --choice,
    checked (read, parsed and compiled by llguidance) before the model loads."""
    given: dict[str, Any] = {}
    if args.json_schema is not None:
        try:
            text = open(args.json_schema, encoding="utf-8").read()  # noqa: SIM115
        except OSError as e:
            _fail(f"--json-schema: cannot read {args.json_schema}: {e.strerror}")
        try:
            given["json_schema"] = json.loads(text)
        except json.JSONDecodeError as e:
            _fail(f"--json-schema: {args.json_schema} is not JSON: {e}")
    elif args.regex is not None:
        given["regex"] = args.regex
    elif args.choice is not None:
        choices = [c for c in args.choice.split(",") if c]
        if not choices:
            _fail("--choice: give at least one non-empty choice, e.g. --choice yes,no")
        given["choice"] = choices
    if not given:
        return given
    try:
        from .constrain import constraint_from
    except ImportError as e:
        _fail(f"{e}; constrained output needs llguidance: pip install 'tokentrail[constrain]'")
    try:
        flag = "--" + next(iter(given)).replace("_", "-")
        constraint_from(**given, param=flag)
    except ValueError as e:
        _fail(str(e))
    return given


def has_chat_template(tokenizer: Any) -> bool:
    """Whether `tokenizer` (mlx-lm wrapper or transformers tokenizer) has a chat template."""
    flag = getattr(tokenizer, "has_chat_template", None)
    if flag is not None:
        return bool(flag)
    return getattr(tokenizer, "chat_template", None) is not None


def _prompt(args: argparse.Namespace, text: str, templated: bool) -> Any:
    """The prompt for stream_generate: chat messages when the template applies, else text."""
    use_chat = args.chat == "on" or (args.chat == "auto" and templated)
    if not use_chat:
        if args.system is not None:
            _fail("--system needs a chat template and the model has none")
        return text
    if not templated:
        _fail("--chat: the model has no chat template; drop --chat to send plain text")
    messages = [] if args.system is None else [{"role": "system", "content": args.system}]
    return [*messages, {"role": "user", "content": text}]


def _pct(p: float) -> str:
    return f"{p:.2f}" if p >= 0.01 else f"{p:.0e}"


def _style(confidence: Any) -> str:
    level = None if confidence is None else confidence.level
    return "" if level is None else LEVEL_STYLES[level]


def show(responses: Any) -> int:
    """Stream coloured text to the terminal, then a summary of the least sure segments."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    out = Console(highlight=False, soft_wrap=True)
    # The summary goes with the text in a terminal, to stderr when stdout is redirected.
    info = out if out.is_terminal else Console(stderr=True, highlight=False)
    segments: list[tuple[str, Any, Any]] = []
    last = None
    start = time.perf_counter()
    shown: list[str] = []  # the channel last printed
    for r in responses:
        last = r
        if r.channel is not None:
            for part in r.channels:
                _print_part(out, part, shown)
                if part.channel in ("reasoning", "content"):
                    segments.append((part.text, part.confidence, part.tokens))
        elif r.text:
            # Text objects are never parsed as markup, so model output prints verbatim.
            out.print(Text(r.text, style=_style(r.confidence)), end="")
            segments.append((r.text, r.confidence, r.last_segment_tokens))
    out.print()
    if last is None:
        return 0
    elapsed = time.perf_counter() - start
    reason = last.finish_reason
    if last.stop_string is not None:
        reason = f"stop string {last.stop_string!r}"
    elif reason == "stop":
        reason = "end-of-sequence token"
    elif reason == "length":
        reason = "token limit"
    info.print(
        Text(
            f"{last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s "
            f"(prompt {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens/s; "
            f"{elapsed:.2f} s in all), finished: {reason}",
            style="dim",
        )
    )
    if last.all_fields:
        info.print(field_table(last.all_fields))
    elif last.fields_error is not None:
        info.print(Text(f"no fields: {last.fields_error}", style="dim"))
    scored = [s for s in segments if s[1] is not None and s[0].strip()]
    scored.sort(key=lambda s: s[1].probability)
    if not scored:
        return 0
    table = Table(title="least confident segments", title_justify="left", show_edge=False)
    table.add_column("segment")
    table.add_column("p", justify="right")
    table.add_column("alternatives for its least likely token")
    for text, conf, spans in scored[:5]:
        weakest = min(
            (t for t in spans if t.logprob is not None), key=lambda t: t.logprob, default=None
        )
        alts = ""
        if weakest is not None and weakest.top_logprobs:
            alts = ", ".join(
                f"{alt_label(a)} {_pct(math.exp(a.logprob))}" for a in weakest.top_logprobs
            )
        table.add_row(
            Text(repr(text), style=_style(conf)),
            _pct(conf.probability),
            Text(alts),
        )
    info.print(table)
    return 0


def _print_part(out: Any, part: Any, shown: list[str]) -> None:
    """One channel segment: reasoning dimmed and italic, content plain, both coloured by
    confidence; marker text is not shown, a line break stands between channels."""
    from rich.text import Text

    if part.channel == "markup" or not part.text:
        return
    if shown and shown[-1] != part.channel:
        out.print()
    if not shown or shown[-1] != part.channel:
        shown.append(part.channel)
    style = _style(part.confidence)
    if part.channel != "content":
        style = f"dim italic {style}".strip()
    out.print(Text(part.text, style=style), end="")


def field_table(fields: list[Any]) -> Any:
    """A rich table of JSON fields: path, value, confidence, alternatives."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title="fields", title_justify="left", show_edge=False)
    for name in ("path", "value", "p", "alternatives"):
        table.add_column(name, justify="right" if name == "p" else "left")
    for f in fields:
        conf = f.confidence
        if f.alternatives is not None:
            alts = Text(", ".join(
                f"{json.dumps(a.value)} {_pct(a.probability)}" for a in f.alternatives
            ))
        else:
            alts = Text(f.reason or "", style="dim")
        table.add_row(
            Text(f.path or "/"), Text(json.dumps(f.value, ensure_ascii=False)),
            Text("" if conf is None else _pct(conf.probability), style=_style(conf)), alts,
        )
    return table


def alt_label(a: Alternative) -> str:
    """An alternative as the table shows it: what choosing it would have shown (a
    character it completes, `<0xC3>` for a byte of none), with its own bytes beside a
    character that bytes held before it helped complete."""
    shown = a.display or a.text
    if a.bytes and shown != show_bytes(a.bytes):
        return f"{shown!r} " + "".join(f"<0x{b:02X}>" for b in a.bytes)
    return repr(shown)
