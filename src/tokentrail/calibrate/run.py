"""`calibrate(...)`: run a labelled set through a model or a server, score every answer,
write items.jsonl as answers finish, then the report (and, if asked, a fitted map).

Items are appended to ``OUT/items.jsonl`` one line each as soon as they are scored, so an
interrupted run loses nothing; ``resume=True`` skips the ids already there. At the end
the file is rewritten in the set's order with `correct` and `calibrated` recomputed from
each line's output and measures (the match rule or calibration may have changed), and
the report is computed from exactly those lines.

``OUT/run.json`` records what decoded the answers (the model's weights and tokenizer or
a server's model name, the answer length and alternatives): a resumed run that would
decode otherwise is refused, since its answers and the ones kept would not be alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import CalibrationError
from .answer import HttpAnswerer, LocalAnswerer, Reply
from .apply import Calibration
from .data import Item, half, read_items
from .match import is_correct
from .measures import measures_of
from .report import build_report, write_html, write_reliability

log = logging.getLogger(__name__)

__all__ = ["ITEMS", "REPORT", "calibrate", "read_rows", "score_rows"]

ITEMS = "items.jsonl"
REPORT = "report.json"
RUN = "run.json"


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The scored lines of an items.jsonl (a last line cut short by an interruption is
    skipped; any other bad line is an error naming it)."""
    rows: list[dict[str, Any]] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return rows
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            rows.append(json.loads(text))
        except json.JSONDecodeError:
            if n == len(lines):
                log.warning("%s: line %d was cut short; it will be scored again", path, n)
                continue
            raise CalibrationError(f"{path}: line {n} is not JSON", n) from None
    return rows


def score_rows(
    items: Iterable[Item],
    rows: Mapping[str, Mapping[str, Any]],
    match: str,
    calibration: Calibration | None,
) -> list[dict[str, Any]]:
    """items.jsonl's lines for `items` (those scored in `rows`, by id), in order, with
    `correct` and `calibrated` computed afresh."""
    out = []
    for item in items:
        r = rows.get(item.id)
        if r is None:
            continue
        exact = "exact" if item.choices else match
        measures = dict(r["measures"])
        if item.choices:  # what guessing gets right (apply.apply_map's chance)
            measures["chance"] = 1.0 / len(item.choices)
        calibrated = None if calibration is None else calibration.answer(measures)[0]
        out.append({"id": item.id, "output": r["output"],
                    "correct": is_correct(r["output"], item.answers, exact),
                    "measures": measures, "calibrated": calibrated})
    return out


def _row(item: Item, a: Reply) -> dict[str, Any]:
    field = a.field_prob() if item.choices else None
    return {"id": item.id, "output": a.output, "correct": None,
            "measures": measures_of(a.tokens, field), "calibrated": None}


def _used_measure(calibration: Calibration | None, rows: list[dict[str, Any]]) -> str | None:
    """The measure the calibration mapped for most answers (None without one)."""
    if calibration is None or not rows:
        return None
    used = Counter(calibration.answer(r["measures"])[1] for r in rows)
    return used.most_common(1)[0][0]


def _sha256(path: str | os.PathLike[str]) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _answerer(
    model: Any, tokenizer: Any, url: str | None, model_name: str | None,
    api_key: str | None, max_tokens: int, top_logprobs: int,
) -> tuple[Any, dict[str, Any]]:
    """The answerer and the fingerprint of what answers."""
    if url is not None:
        answerer = HttpAnswerer(url, model_name, max_tokens, top_logprobs, api_key)
        return answerer, {"name": answerer.model, "engine": "url", "tokenizer": None,
                          "weights": None}
    if model is None or tokenizer is None:
        raise CalibrationError("give a model and its tokenizer, or a url")
    from .fingerprint import model_fingerprint

    fp = model_fingerprint(model, tokenizer, Path(model_name).name if model_name else "")
    return LocalAnswerer(model, tokenizer, max_tokens, top_logprobs), fp


def _progress(total: int, done: int, enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    bar = Progress("{task.description}", BarColumn(), MofNCompleteColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled)
    task = bar.add_task("calibrate", total=total, completed=done)
    return bar, task


def _open_items(out: Path, resume: bool) -> dict[str, dict[str, Any]]:
    path = out / ITEMS
    if path.exists() and not resume and path.stat().st_size:
        raise CalibrationError(
            f"{path} already holds scored answers: pass --resume to continue that run, or "
            "another --out"
        )
    return {r["id"]: r for r in read_rows(path)} if resume else {}


def _decoder(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """What identifies the model that answers: its weights and tokenizer, or a server's
    model name (a local model's display name may be spelled another way)."""
    if fingerprint.get("engine") == "url":
        return {"engine": "url", "name": fingerprint.get("name")}
    return {k: fingerprint.get(k) for k in ("engine", "tokenizer", "weights")}


def _check_run(out: Path, settings: dict[str, Any], resume: bool) -> None:
    """Refuse to add answers decoded otherwise than those already in `out` (its run.json),
    then record `settings` there."""
    path = out / RUN
    if resume and path.exists():
        try:
            before = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            before = {}
        for key, now in settings.items():
            was = before.get(key, now)
            if was != now:
                raise CalibrationError(
                    f"{out} holds answers decoded with {key} {was}, and this run asks "
                    f"{now}: resume with the same settings, or give another --out"
                )
    path.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")


def _warn_if_fitted_otherwise(calibration: Calibration, decoding: Mapping[str, Any]) -> None:
    """A map fitted on replies decoded otherwise (another length limit) still applies, but
    its measures were taken on other replies: say so."""
    for key, now in decoding.items():
        was = calibration.fitted_on.get(key)
        if was is not None and was != now:
            log.warning("the calibration was fitted on answers decoded with %s %s; this run "
                        "decodes with %s %s, so its measures may not match the map's",
                        key, was, key, now)


# long: the run's one sequence (check, answer with progress, rewrite, report, fit) reads
# best in one place; each step is a call.
def calibrate(
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    model: Any = None,
    tokenizer: Any = None,
    url: str | None = None,
    model_name: str | None = None,
    api_key: str | None = None,
    calibration: Calibration | str | os.PathLike[str] | None = None,
    fit: str | os.PathLike[str] | None = None,
    match: str = "words",
    resume: bool = False,
    limit: int | None = None,
    part: int | None = None,
    max_tokens: int = 32,
    top_logprobs: int = 5,
    n_boot: int = 1000,
    progress: bool = False,
) -> dict[str, Any]:
    """Score the labelled set `data` (JSON Lines, see `tokentrail.calibrate.data`) with a
    model (`model`, `tokenizer` from `tokentrail.load`) or a server (`url`, optionally
    `model_name`, `api_key`); write items.jsonl, report.json, reliability.png/.svg and
    report.html into `out`; return the report.

    `calibration` (a `Calibration` or its file, checked against the model's fingerprint)
    adds the calibrated probability as one more measure; `fit` fits maps on these
    answers and saves them there. `match` is the free-text rule (`match.MATCH_RULES`);
    `resume` continues a run in `out`; `limit` takes the first N items; `part` 1 or 2
    takes alternate items (fit on one half, report on the other).
    """
    items = read_items(data, limit)
    if part is not None:
        items = half(items, part)
    is_correct("", ["x"], match)  # an unknown rule fails before the model runs
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    done = _open_items(outdir, resume)
    answerer, fingerprint = _answerer(model, tokenizer, url, model_name, api_key,
                                      max_tokens, top_logprobs)
    decoding = {"max_tokens": max_tokens, "top_logprobs": top_logprobs}
    try:
        _check_run(outdir, {"model": _decoder(fingerprint), **decoding}, resume)
        if calibration is not None and not isinstance(calibration, Calibration):
            calibration = Calibration.load(calibration)
        if calibration is not None:
            calibration.check(fingerprint)
            _warn_if_fitted_otherwise(calibration, decoding)
    except BaseException:
        answerer.close()
        raise
    todo = [it for it in items if it.id not in done]
    bar, task = _progress(len(items), len(items) - len(todo), progress)
    try:
        with bar, (outdir / ITEMS).open("a", encoding="utf-8") as f:
            for item, reply in answerer.answer_many(todo):
                row = _row(item, reply)
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()
                done[item.id] = row
                bar.advance(task)
    finally:
        answerer.close()
    rows = score_rows(items, done, match, calibration)
    tmp = outdir / (ITEMS + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    tmp.replace(outdir / ITEMS)
    settings = {"data": str(data), "match": match, "part": part, "model": fingerprint["name"],
                "calibration": None if calibration is None else calibration.source or True,
                "calibrated_by": _used_measure(calibration, rows)}
    report = build_report(rows, n_boot=n_boot, **settings)
    (outdir / REPORT).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if not write_reliability(report, outdir, f"{Path(data).name} · {fingerprint['name']}"):
        log.warning("no reliability diagram (reliability.png, .svg, and in report.html): "
                    "matplotlib is not installed; pip install 'tokentrail[calibrate]'")
    write_html(report, outdir)
    if fit is not None:
        _fit(rows, fingerprint, data, match, part, decoding, fit)
    return report


def _fit(
    rows: list[dict[str, Any]], fingerprint: dict[str, Any], data: Any, match: str,
    part: int | None, decoding: dict[str, int], path: str | os.PathLike[str],
) -> None:
    """Fit maps on `rows` and save them to `path`, with what they were fitted on: the
    set (name, SHA-256, part, size, accuracy), the match rule and the decoding settings
    (`decoding`: the answer length and alternatives the measures were taken with)."""
    from .fit import fit_calibration

    fitted_on = {"data": Path(data).name, "sha256": _sha256(data), "part": part,
                 "n": len(rows), "match": match, **decoding,
                 "accuracy": sum(bool(r["correct"]) for r in rows) / len(rows)}
    cal = fit_calibration(rows, fingerprint, fitted_on)
    Path(path).write_text(json.dumps(cal.to_dict(), indent=1) + "\n", encoding="utf-8")
