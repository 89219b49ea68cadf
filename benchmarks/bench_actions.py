"""What acting on confidence buys on a real question set (issue #31): accuracy and tokens.

One `tokentrail serve --engine llamacpp` on SmolLM2-135M-Instruct (Q4_1 GGUF) answers a
fixed subset of `benchmarks/data/calibration/` (facts and arithmetic, with their
accepted answers; loaded by `tokentrail.calibrate.data.read_items`, judged by
`tokentrail.calibrate.match.is_correct`, the "words" rule), with every setting below on
the same questions in one run:

- **greedy**: n = 1, temperature 0;
- **n = 8 sampled** (temperature `--temperature`, seed fixed per question): one request
  with ``"tokentrail": {"vote": "confidence"}``, read three ways: the **majority** winner
  (the same groups re-ranked by count, `tokentrail.output.vote.tally`), the
  **confidence-weighted** winner (the server's `tokentrail.vote`), and "any of 8 right"
  (the ceiling a vote could reach);
- **n = 8 early stop**: the same request and seed with ``"early_stop": true``: the same
  samples (each choice's seed is the request's + its index), cut where early stop
  decided, so its tokens are paired with the run above;
- **field retry** (`--retry`, once the retry key acts on main): the answer asked as JSON
  ``{"answer": string}``, greedy, with and without ``"retry": {"below": P, "max": 2}``.

A vote's answer is the text of its winner's `choice` (the most confident reply of the
winning group). Tokens are `usage.completion_tokens` summed over questions (all n
choices); per question, the median ratio early-stop / full n = 8.

    flock /tmp/tt-bench.lock .venv/bin/python benchmarks/bench_actions.py \\
        --questions 80 --output benchmarks/results/actions.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import wait
from bench_retry import ANSWER_SCHEMA, questions
from bench_server import free_port

from tokentrail.calibrate.data import Item
from tokentrail.calibrate.match import is_correct
from tokentrail.output.vote import Ballot, tally

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "benchmarks" / "data" / "calibration"
GGUF = Path.home() / ".cache/tokentrail/models/SmolLM2-135M-Instruct.Q4_1.gguf"
#: The id prefixes of the questions in arithmetic.jsonl.
ARITHMETIC = ("add1", "add2", "add3", "mul1", "mul2")
def start(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "tokentrail", "serve", "--engine", "llamacpp",
        "--model", str(args.gguf), "--port", str(port), "--max-batch", str(args.n),
        "--n-threads", str(args.threads), "--n-ctx", str(args.n_ctx), "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait(url, proc)
    return proc, url


def ask(url: str, item: Item, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    body = {"messages": list(item.prompt), "max_tokens": args.max_tokens, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def _right(text: str, item: Item) -> bool:
    return is_correct(text, item.answers)


def sampled(url: str, item: Item, args: argparse.Namespace, seed: int,
            early_stop: bool) -> dict[str, Any]:  # fmt: skip
    """One n = 8 request: correctness of each rule's winner, tokens, stopped choices."""
    options = {"vote": "confidence", "early_stop": early_stop}
    r = ask(url, item, args, n=args.n, temperature=args.temperature, seed=seed,
            tokentrail=options)  # fmt: skip
    texts = [c["message"]["content"] or "" for c in r["choices"]]
    ext = r["tokentrail"]
    found = ext["vote"]
    out: dict[str, Any] = {"tokens": r["usage"]["completion_tokens"],
                           "stopped": len(found["stopped"])}  # fmt: skip
    win = found["winner"]
    out["confidence"] = win is not None and _right(texts[win["choice"]], item)
    ballots = [
        Ballot(i, e["ballot"]["answer"] or "", e["ballot"]["confidence"],
               stopped=e.get("stopped_by") == "early_stop")
        for i, e in enumerate(ext["choices"])
    ]  # fmt: skip
    majority = tally(ballots, "majority")
    out["majority"] = majority.choice is not None and _right(texts[majority.choice], item)
    voters = [t for t, b in zip(texts, ballots, strict=True) if not b.stopped]
    out["any"] = any(_right(t, item) for t in voters)
    out["single"] = statistics.fmean(_right(t, item) for t in texts)
    out["saved_at_most"] = r["usage"].get("tokentrail", {}).get("saved_tokens_at_most", 0)
    return out


def retried(url: str, item: Item, args: argparse.Namespace, retry: bool) -> dict[str, Any]:
    """Greedy, the answer as JSON; with `retry`, low-confidence leaves sampled again."""
    extra: dict[str, Any] = {
        "temperature": 0.0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
    }  # fmt: skip
    if retry:
        extra["tokentrail"] = {"retry": {"below": args.retry_below, "max": 2}}
    r = ask(url, item, args, **extra)
    text = r["choices"][0]["message"]["content"] or ""
    try:
        answer = str(json.loads(text).get("answer", ""))
    except (ValueError, AttributeError):
        answer = ""
    attempts = sum(len(f.get("attempts") or ()) for f in r["tokentrail"].get("fields") or ())
    return {"right": _right(answer, item), "tokens": r["usage"]["completion_tokens"],
            "attempts": attempts}  # fmt: skip


def run(args: argparse.Namespace, url: str, items: list[Item]) -> dict[str, Any]:
    """Every setting on each question in turn, until the questions or --budget-s run out."""
    results: dict[str, Any] = {"greedy": [], "n8": [], "early": [], "json": [], "retry": []}
    tic = time.perf_counter()
    for k, item in enumerate(items):
        if args.budget_s and time.perf_counter() - tic > args.budget_s:
            print(f"budget spent: {k} of {len(items)} questions", file=sys.stderr)
            break
        r = ask(url, item, args, temperature=0.0)
        results["greedy"].append({
            "right": _right(r["choices"][0]["message"]["content"] or "", item),
            "tokens": r["usage"]["completion_tokens"],
        })  # fmt: skip
        seed = args.seed + 1000 * k
        results["n8"].append(sampled(url, item, args, seed, early_stop=False))
        results["early"].append(sampled(url, item, args, seed, early_stop=True))
        if args.retry:
            results["json"].append(retried(url, item, args, retry=False))
            results["retry"].append(retried(url, item, args, retry=True))
        results["ids"] = [it.id for it in items[: k + 1]]
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        print(f"{k + 1}/{len(items)} {time.perf_counter() - tic:.0f} s", file=sys.stderr,
              flush=True)  # fmt: skip
    return results


def _acc(rows: list[dict[str, Any]], key: str) -> str:
    """The share of questions right (`key` a bool; "single": each one's share of the n)."""
    return f"{100 * statistics.fmean(float(r[key]) for r in rows):.1f}%"


def _run_argv() -> list[str]:
    """This command's arguments without --from-json and its value."""
    argv, out = sys.argv[1:], []
    skip = False
    for a in argv:
        if skip or a == "--from-json":
            skip = not skip
            continue
        out.append(a)
    return out


def _tokens(rows: list[dict[str, Any]]) -> int:
    return sum(r["tokens"] for r in rows)


# long: the report is one table and its notes, written in the order they are read.
def report(args: argparse.Namespace, results: dict[str, Any], items: list[Item],
           seconds: float) -> str:  # fmt: skip
    g, n8, early = results["greedy"], results["n8"], results["early"]
    q = len(g)
    facts = sum(1 for it in items[:q] if it.id.split("-")[0] not in ARITHMETIC)
    ratios = [e["tokens"] / f["tokens"] for e, f in zip(early, n8, strict=True) if f["tokens"]]
    rows = [
        ("plain greedy (n = 1, T = 0)", _acc(g, "right"), _tokens(g)),
        (f"one sample (n = 8, T = {args.temperature}), mean of the 8", _acc(n8, "single"),
         _tokens(n8)),
        ("n = 8, majority vote", _acc(n8, "majority"), _tokens(n8)),
        ("n = 8, confidence-weighted vote", _acc(n8, "confidence"), _tokens(n8)),
        ("n = 8, early stop + confidence-weighted vote", _acc(early, "confidence"),
         _tokens(early)),
        ("n = 8, early stop + majority vote", _acc(early, "majority"), _tokens(early)),
        ("(ceiling) n = 8, any of the 8 right", _acc(n8, "any"), _tokens(n8)),
    ]  # fmt: skip
    if args.retry:
        rows += [("greedy, answer as JSON", _acc(results["json"], "right"),
                  _tokens(results["json"])),
                 (f"field retry (below {args.retry_below}, max 2)",
                  _acc(results["retry"], "right"), _tokens(results["retry"]))]  # fmt: skip
    else:
        rows += [("field retry", "(lead fills: run with --retry once retry is on main)", "")]
    lines = [
        "# Acting on confidence: votes, early stop, field retry (SmolLM2-135M-Instruct)",
        "",
        f"{q} questions ({facts} facts, {q - facts} arithmetic) from "
        "`benchmarks/data/calibration/`, judged by `calibrate.match.is_correct` (words).",
        f"`tokentrail serve --engine llamacpp`, {args.gguf.name}, --max-batch {args.n}, "
        f"--n-threads {args.threads}; max_tokens {args.max_tokens}; sampled runs at "
        f"temperature {args.temperature}, seed {args.seed} + 1000 * question"
        + (f"; --budget-s {args.budget_s:g} (of {len(items)} questions asked for)."
           if args.budget_s else "."),
        "",
        "| setting | accuracy | completion tokens (all choices, all questions) |",
        "|---|---:|---:|",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows),
        "",
        "Early stop, paired with the full n = 8 run (same seeds, so the same samples cut "
        "short):",
        "",
        f"- tokens early stop / full: {_tokens(early) / max(_tokens(n8), 1):.3f} overall, "
        f"median per question {statistics.median(ratios):.3f}",
        f"- choices stopped: {sum(e['stopped'] for e in early)} of {args.n * q}; questions "
        f"with a stop: {sum(1 for e in early if e['stopped'])} of {q}",
        f"- tokens saved: {_tokens(n8) - _tokens(early)} measured; the server's "
        f"`usage.tokentrail.saved_tokens_at_most`: {sum(e['saved_at_most'] for e in early)}",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs (shared); "
        f"run took {seconds:.0f} s.",
        "",
        "Command:",
        "",
        "```sh",
        "flock /tmp/tt-bench.lock .venv/bin/python benchmarks/bench_actions.py "
        + " ".join(_run_argv()),
        "```",
    ]
    if args.from_json:
        lines += ["", f"(This report was written again from that run's JSON with "
                      f"`--from-json {args.from_json.name}`.)"]  # fmt: skip
    if args.retry:
        attempts = sum(r["attempts"] for r in results["retry"])
        lines += ["", f"Field retry: {attempts} attempts reported in `fields[].attempts`."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=GGUF)
    p.add_argument("--questions", type=int, default=80)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--budget-s", type=float, default=0,
                   help="ask no new question after this many seconds (0: no limit)")
    p.add_argument("--retry", action="store_true", help="add the field-retry rows")
    p.add_argument("--retry-below", type=float, default=0.5)
    p.add_argument("--output", type=Path, help="write the markdown report here")
    p.add_argument("--json", type=Path, help="write the per-question results here")
    p.add_argument("--from-json", type=Path,
                   help="only write the report of a run's --json file (same other options)")
    args = p.parse_args()
    items = questions(args.questions)
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        text = report(args, results, items, results.get("seconds", 0.0))
        print(text)
        if args.output:
            args.output.write_text(text)
        return
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start(args, Path(tmp) / "server.log")
        try:
            tic = time.perf_counter()
            results = run(args, url, items)
            seconds = results["seconds"] = time.perf_counter() - tic
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
        finally:
            proc.terminate()
            proc.wait(30)
    text = report(args, results, items, seconds)
    print(text)
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
