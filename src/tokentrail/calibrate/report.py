"""The report of a calibration run, computed from its scored answers (items.jsonl rows):
report.json, the reliability diagram (reliability.png, reliability.svg), report.html and
a table for the terminal. Everything here is a function of the rows, so the report can
always be recomputed from items.jsonl.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..segment import LEVEL_NAMES, probability_level
from .consistency import consistency, shortfall_p
from .measures import MEASURES
from .metrics import reliability_bins, summarize

__all__ = ["build_report", "by_level", "print_table", "write_html", "write_reliability"]

#: Every measure a report may hold: the raw ones, then the calibrated probability.
REPORTED = (*MEASURES, "calibrated")


def _pairs(rows: Sequence[Mapping[str, Any]], name: str) -> tuple[list[float], list[int]]:
    conf, correct = [], []
    for r in rows:
        v = r.get("calibrated") if name == "calibrated" else r["measures"].get(name)
        if v is not None and math.isfinite(v):
            conf.append(float(v))
            correct.append(int(bool(r["correct"])))
    return conf, correct


def build_report(
    rows: Sequence[Mapping[str, Any]], n_boot: int = 1000, seed: int = 0, **extra: Any
) -> dict[str, Any]:
    """report.json's content: n, accuracy, the primary measure's name, and per measure
    (those any answer has) ECE (equal width and equal mass), Brier, AUROC, PRR, 95%
    intervals, its reliability bins, and what the same confidences would show if they
    were perfectly calibrated (``if_calibrated``: each ECE's floor and how unusual the
    measured one is against it; each bin's ``band``: see `consistency`). The primary
    measure is the calibrated probability when there is one, else the raw measure with
    the highest AUROC among those every answer has. `extra` keys are added as they are
    (the run's settings)."""
    n = len(rows)
    measures: dict[str, Any] = {}
    for name in REPORTED:
        conf, correct = _pairs(rows, name)
        if not conf:
            continue
        figures = summarize(conf, correct, n_boot, seed)
        floors = consistency(conf, correct, seed=seed)
        figures["if_calibrated"] = {k: floors[k] for k in ("ece", "ece_equal_mass")}
        figures["bins"] = [{**b, "band": band} for b, band in
                           zip(reliability_bins(conf, correct), floors["bands"], strict=True)]
        measures[name] = figures
    full = [m for m in MEASURES if m in measures and measures[m]["n"] == n]
    if "calibrated" in measures:
        primary = "calibrated"
    elif full:
        primary = max(full, key=lambda m: (measures[m]["auroc"] or 0.0, -MEASURES.index(m)))
    else:
        primary = next(iter(measures), None)
    accuracy = sum(bool(r["correct"]) for r in rows) / n if n else None
    levels = None if primary is None else by_level(*_pairs(rows, primary))
    return {"n": n, "accuracy": accuracy, "primary": primary, "measures": measures,
            "levels": levels, **extra}


def by_level(conf: Sequence[float], correct: Sequence[int]) -> list[dict[str, Any]]:
    """Per segment level (`segment.probability_level` of the value): how many answers,
    their mean confidence, how many were right, and ``p_shortfall``: how often answers
    with those figures would be right as rarely or more rarely (`shortfall_p`). The check
    that an answer shown as "certain" is right at least as often as its number says."""
    out = []
    for level, name in enumerate(LEVEL_NAMES):
        picked = [(c, y) for c, y in zip(conf, correct, strict=True)
                  if probability_level(c) == level]
        said = [c for c, _ in picked]
        right = [y for _, y in picked]
        out.append({
            "level": level, "name": name, "n": len(picked),
            "confidence": sum(said) / len(picked) if picked else None,
            "accuracy": sum(right) / len(picked) if picked else None,
            "p_shortfall": shortfall_p(said, right) if picked else None,
        })
    return out


def _best_raw(report: Mapping[str, Any]) -> str | None:
    """The raw measure to show: the one the calibration mapped, else the primary one,
    else the one with the highest AUROC."""
    raw = [m for m in MEASURES if m in report["measures"]]
    for name in (report.get("calibrated_by"), report["primary"]):
        if name in raw:
            return name
    return max(raw, key=lambda m: report["measures"][m]["auroc"] or 0.0) if raw else None


def write_reliability(report: Mapping[str, Any], out: Path, title: str = "") -> list[Path]:
    """reliability.png and .svg: accuracy against confidence per bin, for a raw measure
    (`_best_raw`: before) and, when present, the calibrated probability (after).
    [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    shown = [m for m in (_best_raw(report), "calibrated") if m and m in report["measures"]]
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 4.2), squeeze=False)
    for ax, name in zip(axes[0], shown, strict=True):
        figures = report["measures"][name]
        bins = [b for b in figures["bins"] if b["n"]]
        ax.plot([0, 1], [0, 1], color="#999", linestyle="--", linewidth=1, label="perfect")
        ax.bar([(b["lo"] + b["hi"]) / 2 for b in bins], [b["accuracy"] for b in bins],
               width=0.09, color="#4c72b0", alpha=0.35, label="accuracy per bin")
        ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], "o-",
                color="#4c72b0", label="mean confidence → accuracy")
        banded = [b for b in bins if b.get("band")]
        if banded:
            ax.vlines([b["confidence"] for b in banded], [b["band"][0] for b in banded],
                      [b["band"][1] for b in banded], color="#999", linewidth=3, alpha=0.6,
                      label="95% of a calibrated measure")
        for b in bins:
            ax.annotate(str(b["n"]), ((b["lo"] + b["hi"]) / 2, 0.02), ha="center", fontsize=7)
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel=f"{name}", ylabel="accuracy")
        ax.set_title(f"{name}: ECE {figures['ece']:.3f}{_floor_note(figures)}\nAUROC "
                     f"{'-' if figures['auroc'] is None else format(figures['auroc'], '.2f')}",
                     fontsize=9)
        ax.legend(loc="upper left", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    paths = [out / "reliability.png", out / "reliability.svg"]
    for p in paths:
        fig.savefig(p, dpi=110)
    plt.close(fig)
    return paths


def _floor_note(figures: Mapping[str, Any]) -> str:
    floor = (figures.get("if_calibrated") or {}).get("ece")
    return "" if not floor else f" (if calibrated: {floor['median']:.3f}, p {floor['p']:.2f})"


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def _rows_of(report: Mapping[str, Any]) -> list[list[str]]:
    out = []
    for name, f in report["measures"].items():
        ci = f["ci95"].get("ece")
        floor = (f.get("if_calibrated") or {}).get("ece") or {}
        out.append([
            name + (" *" if name == report["primary"] else ""), str(f["n"]), _fmt(f["ece"]),
            "-" if ci is None else f"{ci[0]:.3f}–{ci[1]:.3f}", _fmt(floor.get("median")),
            _fmt(floor.get("p")), _fmt(f["ece_equal_mass"]),
            _fmt(f["brier"]), _fmt(f["auroc"]), _fmt(f["prr"]),
        ])
    return out


HEADER = ["measure", "n", "ECE", "ECE 95%", "floor", "p", "ECE (mass)", "Brier",
          "AUROC", "PRR"]


LEVEL_HEADER = ["level", "n", "said", "right", "p short"]


def _level_rows(report: Mapping[str, Any]) -> list[list[str]]:
    """The primary measure's levels that hold answers, most confident first."""
    return [[e["name"], str(e["n"]), _fmt(e["confidence"]), _fmt(e["accuracy"]),
             _fmt(e.get("p_shortfall"))]
            for e in reversed(report.get("levels") or []) if e["n"]]


#: What the levels' columns mean (under their table on the terminal and the page).
LEVEL_NOTE = (
    "said: the level's mean figure; right: the share of its answers right; p short: the "
    "share of draws, calibrated, right as rarely or more rarely (small: the level "
    "overstates its answers beyond their number)."
)

#: What the table's floor columns mean (under it on the terminal and the page).
NOTE = (
    "floor: the median ECE the same confidences show on this many answers when "
    "drawn perfectly calibrated; p: the share of such draws with an ECE at least the "
    "measured one (small: miscalibrated beyond the set's noise)."
)


def _rich_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]],
                padding: Any, no_wrap: Sequence[str] = ()) -> Any:
    """A rich table: the first column left, the rest right, a rule under the header."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, padding=padding, show_edge=False)
    for i, h in enumerate(header):
        table.add_column(h, justify="right" if i else "left", no_wrap=h in no_wrap)
    for row in rows:
        table.add_row(*row)
    return table


def print_table(report: Mapping[str, Any], console: Any = None) -> None:
    """The report as a rich table (the primary measure starred), and under it the
    primary measure's levels that hold answers."""
    from rich.console import Console

    console = console or Console()
    # (one space between columns, no edges: ten columns fit an 80-column terminal whole)
    console.print(_rich_table(f"{report['n']} answers, accuracy {_fmt(report['accuracy'])}",
                              HEADER, _rows_of(report), 0, ("measure", "ECE 95%")))
    console.print(NOTE, style="dim")
    levels = _level_rows(report)
    if levels:
        console.print(_rich_table(f"levels of {report['primary']}", LEVEL_HEADER, levels,
                                  (0, 1)))
        console.print(LEVEL_NOTE, style="dim")


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]], note: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table><p>{html.escape(note)}</p>"


def write_html(report: Mapping[str, Any], out: Path) -> Path:
    """report.html: the table, the levels and the reliability diagram, one
    self-contained page."""
    svg_path = out / "reliability.svg"
    svg = svg_path.read_text(encoding="utf-8") if svg_path.exists() else ""
    svg = svg[svg.find("<svg"):] if "<svg" in svg else ""
    settings = {k: v for k, v in report.items() if k not in ("measures", "levels")}
    primary = html.escape(str(report["primary"]))
    levels = _level_rows(report)
    level_table = "" if not levels else (
        f"<h2>Levels of {primary}</h2>" + _html_table(LEVEL_HEADER, levels, LEVEL_NOTE))
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>tokentrail calibrate"
        "</title><style>body{font-family:sans-serif;margin:2em}table{border-collapse:"
        "collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
        "td:first-child{text-align:left}</style></head><body>"
        f"<h1>Calibration report</h1><p>{report['n']} answers, accuracy "
        f"{_fmt(report['accuracy'])}; primary measure <b>{primary}</b> (starred).</p>"
        f"{_html_table(HEADER, _rows_of(report), NOTE)}{level_table}{svg}"
        f"<pre>{html.escape(json.dumps(settings, indent=1))}</pre></body></html>"
    )
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
