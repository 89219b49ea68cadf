"""`tokentrail calibrate DATA.jsonl --out DIR`: score a labelled set, report, fit.

Bad input (a malformed line, an unknown rule, a map for another model) exits 2 with one
line on stderr, naming the line number where there is one.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from ..errors import CalibrationError, TokentrailError
from ..usage import add_command, fail

log = logging.getLogger(__name__)

__all__ = ["register", "run"]


#: The whole-number options: flag, default, metavar, help.
_NUMBERS = (
    ("--limit", None, "N", "only the first N questions"),
    ("--max-tokens", 32, "N", "longest answer in tokens (default: 32)"),
    ("--top-logprobs", 5, "K", "alternatives per token for margin and entropy (default: 5)"),
    ("--bootstrap", 1000, "B", "bootstrap resamples for the 95%% intervals (default: 1000)"),
)


def register(sub: Any) -> None:
    """Add `calibrate` to the `tokentrail` command."""
    from .match import MATCH_RULES

    p = add_command(
        sub, "calibrate", "score a labelled question set: are the confidences probabilities?",
        "Run DATA (JSON Lines: id, messages or prompt, answer, optional choices) through a",
        "model or an OpenAI-compatible server, greedy, and report per confidence measure ECE,",
        "Brier, AUROC and PRR with 95% intervals (report.json, items.jsonl, reliability.png,",
        "report.html in --out). --fit saves calibration maps; --calibration applies one.",
    )
    p.add_argument("data", metavar="DATA.jsonl", help="the labelled questions")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the outputs")
    p.add_argument("--engine", default="mlx", metavar="E",
                   help="engine for --model: mlx, torch, llamacpp, vllm (default: mlx)")
    p.add_argument("--model", metavar="M",
                   help="model folder, GGUF file or name (default: the built-in demo model; "
                   "with --url, the server's model id)")
    p.add_argument("--url", metavar="URL", help="an OpenAI-compatible server instead")
    p.add_argument("--api-key", metavar="KEY", help="bearer token for --url")
    p.add_argument("--fit", metavar="OUT.json", help="fit calibration maps on these answers")
    p.add_argument("--calibration", metavar="FILE",
                   help="apply a fitted calibration (a file, or a built-in one's name: smollm2)")
    p.add_argument("--match", default="words", choices=sorted(MATCH_RULES),
                   help="how free text is matched to the answer (default: words)")
    p.add_argument("--resume", action="store_true",
                   help="continue a run in --out, skipping the ids already scored")
    p.add_argument("--half", type=int, choices=(1, 2), metavar="{1,2}",
                   help="only alternate questions: 1 = 1st, 3rd, ...; 2 = 2nd, 4th, ...")
    for flag, default, meta, text in _NUMBERS:
        p.add_argument(flag, type=int, default=default, metavar=meta, help=text)
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> str | None:
    if args.url and args.engine != "mlx":
        return "give --engine with --model, or --url, not both"
    if args.limit is not None and args.limit < 1:
        return f"--limit must be at least 1, got {args.limit}"
    if args.max_tokens < 1:
        return f"--max-tokens must be at least 1, got {args.max_tokens}"
    if not 0 <= args.top_logprobs <= 20:
        return f"--top-logprobs must be in 0..20, got {args.top_logprobs}"
    if args.bootstrap < 0:
        return f"--bootstrap must be at least 0, got {args.bootstrap}"
    return None


def run(args: argparse.Namespace) -> int:
    """Run `tokentrail calibrate`; 0 on success, 2 on bad input."""
    from ..generate import load
    from .data import read_items
    from .report import print_table
    from .run import calibrate

    problem = _check(args)
    if problem:
        return fail(problem)
    try:
        read_items(args.data)  # a malformed line fails before a model loads
        model = tokenizer = None
        if args.url is None:
            model, tokenizer = load(args.model, engine=args.engine)
        report = calibrate(
            args.data, args.out, model=model, tokenizer=tokenizer, url=args.url,
            model_name=args.model, api_key=args.api_key, calibration=args.calibration,
            fit=args.fit, match=args.match, resume=args.resume, limit=args.limit,
            part=args.half, max_tokens=args.max_tokens, top_logprobs=args.top_logprobs,
            n_boot=args.bootstrap, progress=not args.quiet,
        )
    except CalibrationError as e:
        return fail(e)
    except (TokentrailError, OSError) as e:
        return fail(f"{type(e).__name__}: {e}" if not str(e) else e)
    if not args.quiet:
        print_table(report)
        if args.fit:
            print(fit_summary(args.fit))
    return 0


def fit_summary(path: str) -> str:
    """One line on the calibration `--fit` saved at `path`: the measure its free-text
    answers are calibrated with (its kind of map, its bins, and its cross-validated ECE
    against a calibrated measure's on the same answers), and whether those
    answers back the most confident level (the map's ``ceiling``,
    `tokentrail.calibrate.fit.top_ceiling`)."""
    from ..segment import CONFIDENCE_LEVELS
    from .apply import Calibration

    cal = Calibration.load(path)
    name = cal.first_measure() or cal.ranking[0]
    spec, top = cal.maps[name], CONFIDENCE_LEVELS[-1]
    ceiling = spec.get("ceiling")
    if ceiling is None:
        backed = "has no ceiling"
    elif ceiling >= top:
        backed = f"is backed by these answers up to {ceiling:.3f}"
    else:
        backed = "is not backed by these answers: nothing will be shown there"
    kind = spec["kind"] + (f" in {len(spec['bins']['p'])} bins" if "bins" in spec else "")
    held = spec.get("cv_ece")
    expect = "" if not held else (
        f"; cross-validated, its ECE is {held['ece']:.3f} where a calibrated measure on "
        f"these answers shows {held['if_calibrated']:.3f}")
    return (f"calibration saved to {path}: answers use {name} ({kind}){expect}; the most "
            f"confident level (calibrated >= {top}) {backed}")
