"""How well the calibration fitter's maps hold on answers they were not fitted on.

Reads the items.jsonl of `tokentrail calibrate` runs (answers decoded once) and, with the
library's own fitter (`tokentrail.calibrate.fit.fit_calibration`) and metrics, reports:

- half -> half within each set: fit on alternate answers (1st, 3rd, ...: `--half 1`),
  report on the others, and the roles swapped;
- transfer: fit on all of one set, report on all of another, every ordered pair;
- random halvings (``--splits N``): N random splits of each set in two, fit on one half,
  report on the other; the median and 10th-90th percentiles of ECE and of its floor
  (one alternate split is one draw of a noisy figure);
- ``--no-ceilings``: the same with the maps' ceilings removed (what backs the most
  confident level, `tokentrail.calibrate.fit.top_ceiling`): before and after;
- ``--first MEASURE``: free-text answers calibrated with MEASURE's map, not the one the
  fitter ranks first (what another choice of measure would have given);
- leave one set out (``--pooled``): fit on every other set pooled, report on the one
  left out (what a map fitted on a broad mix promises a set it never saw);
- by family (``--families``): fit on every family of the sets but one, report on the one
  left out (families are the id's prefix before the first "-").

Each row: ECE (10 equal-width bins), Brier and log loss of the `calibrated` confidence,
the measure and kind of map used for most answers, the answers shown at the most
confident level (calibrated >= 0.9: how many, their mean calibrated probability, the
share right), and the ECE a perfectly calibrated
confidence shows on the same answers and how unusual the measured one is against it
("floor" and "p": `tokentrail.calibrate.consistency`, the figures report.json gives as
``if_calibrated``; in random halvings, how many of the fits' other halves reject
calibration at p < 0.05, which a perfectly calibrated map does in about 5%). No
decoding: run `tokentrail calibrate DATA --out DIR` first.

    python benchmarks/calibration_study.py runs/facts runs/knowledge runs/gen [--families]
"""

from __future__ import annotations

import argparse
import functools
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokentrail.calibrate.consistency import consistency
from tokentrail.calibrate.fit import fit_calibration, log_loss
from tokentrail.calibrate.metrics import brier, ece
from tokentrail.calibrate.report import by_level
from tokentrail.calibrate.run import ITEMS, read_rows


def load(folder: Path) -> list[dict[str, Any]]:
    return read_rows(folder / ITEMS if folder.is_dir() else folder)


def family(row: Mapping[str, Any]) -> str:
    return str(row["id"]).split("-")[0].rstrip("0123456789")


def evaluate(fit_rows: Sequence[Mapping[str, Any]], test_rows: Sequence[Mapping[str, Any]],
             ceilings: bool = True, first: str | None = None) -> dict[str, Any]:
    cal = fit_calibration(fit_rows, {}, {"rows": len(fit_rows)})
    if first in cal.maps:  # that measure's map before the fitter's ranking
        cal.ranking = [first, *(m for m in cal.ranking if m != first)]
    if not ceilings:  # the maps as fitted, without what backs the top level
        for spec in cal.maps.values():
            spec.pop("ceiling", None)
    got = [(cal.answer(r["measures"]), bool(r["correct"])) for r in test_rows]
    used = Counter(name for (p, name), _ in got if p is not None)
    pairs = [(p, y) for (p, _), y in got if p is not None]
    p = np.array([a for a, _ in pairs])
    y = np.array([b for _, b in pairs], dtype=np.float64)
    top = used.most_common(1)[0][0] if used else "-"
    kind = cal.maps[top]["kind"] if top in cal.maps else "-"
    levels = by_level(p.tolist(), y.tolist())  # report.json's levels, on this half
    top_level = levels[-1]  # shown at the most confident level
    certain = (top_level["n"], top_level["confidence"] or 0.0, top_level["accuracy"] or 0.0)
    high = next(e for e in reversed(levels) if e["n"])  # the highest level shown
    floor = consistency(p, y)["ece"]
    return {"n": len(p), "accuracy": float(y.mean()), "ece": ece(p, y), "brier": brier(p, y),
            "log_loss": log_loss(p, y), "floor": floor["median"], "p": floor["p"],
            "measure": top, "kind": kind, "certain": certain,
            "highest": (high["name"], high["n"], high["confidence"], high["accuracy"],
                        high["p_shortfall"])}


def line(name: str, r: Mapping[str, Any]) -> str:
    n, said, right = r["certain"]
    top = f"{n}: {said:.2f} / {right:.2f}" if n else "none"
    lv, hn, hsaid, hright, hp = r["highest"]
    return (f"| {name} | {r['n']} | {r['accuracy']:.2f} | **{r['ece']:.3f}** | {r['floor']:.3f} "
            f"| {r['p']:.3f} | {r['brier']:.3f} | {r['log_loss']:.3f} | {r['measure']} "
            f"({r['kind']}) | {top} | {lv} {hn}: {hsaid:.2f} / {hright:.2f}, p {hp:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (or items.jsonl files)")
    ap.add_argument("--families", action="store_true", help="also leave one family out")
    ap.add_argument("--pooled", action="store_true",
                    help="also fit on every other set pooled, report on the one left out")
    ap.add_argument("--splits", type=int, default=0, metavar="N",
                    help="also N random halvings of each set (the spread of half -> half)")
    ap.add_argument("--no-ceilings", action="store_true",
                    help="remove the maps' ceilings (what backs the top level: before/after)")
    ap.add_argument("--first", metavar="MEASURE",
                    help="calibrate free-text answers with this measure's map")
    args = ap.parse_args()
    study = functools.partial(evaluate, ceilings=not args.no_ceilings, first=args.first)
    sets = {p.name if p.is_dir() else p.parent.name: load(p) for p in args.runs}
    print("| fitted on → reported on | n | right | ECE | floor | p | Brier | log loss "
          "| measure (map) | certain: n, said / right | highest level shown: n, said / right, "
          "p of a shortfall |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
    for name, rows in sets.items():
        a, b = rows[0::2], rows[1::2]
        print(line(f"{name} half 1 → half 2", study(a, b)))
        print(line(f"{name} half 2 → half 1", study(b, a)))
    for fit_name, fit_rows in sets.items():
        for test_name, test_rows in sets.items():
            if fit_name != test_name:
                print(line(f"{fit_name} → {test_name}",
                           study(fit_rows, test_rows)))
    if args.pooled and len(sets) > 2:
        for test_name, test_rows in sets.items():
            rest = [r for name, rows in sets.items() if name != test_name for r in rows]
            print(line(f"all but {test_name} → {test_name}", study(rest, test_rows)))
    if args.splits:
        print(f"\nRandom halvings ({args.splits} per set, fit on one half, report on the other):"
              " calibrated ECE and its floor, median [10th–90th percentile]\n")
        print("| set | n per half | ECE | floor | ECE − floor | p < 0.05 | top level shown "
              "| of those, right less often than said | highest level shown: right less "
              "often than said, at p < 0.05 |")
        print("|---|---:|---|---|---|---:|---:|---:|---:|")
        for name, rows in sets.items():
            rng = np.random.default_rng(0)  # each set's splits whatever sets come before it
            got, shown, overstated, rejected, short, short_p = [], 0, 0, 0, 0, 0
            for _ in range(args.splits):
                order = rng.permutation(len(rows))
                half = len(rows) // 2
                r = study([rows[i] for i in order[:half]], [rows[i] for i in order[half:]])
                got.append((r["ece"], r["floor"], r["ece"] - r["floor"]))
                rejected += r["p"] < 0.05
                n, said, right = r["certain"]
                shown += n > 0
                overstated += n > 0 and right < said
                _, _, hsaid, hright, hp = r["highest"]
                short += hright < hsaid
                short_p += hp < 0.05
            q = np.percentile(np.array(got), [50, 10, 90], axis=0)
            cells = " | ".join(f"{q[0, j]:.3f} [{q[1, j]:.3f}–{q[2, j]:.3f}]" for j in range(3))
            print(f"| {name} | {len(rows) - len(rows) // 2} | {cells} | {rejected} | {shown} "
                  f"| {overstated} | {short}, {short_p} |")
    if args.families:
        every = [r for rows in sets.values() for r in rows]
        for fam in sorted({family(r) for r in every}):
            test = [r for r in every if family(r) == fam]
            rest = [r for r in every if family(r) != fam]
            if len(test) >= 20:
                print(line(f"all but {fam} → {fam}",
                           study(rest, test)))


if __name__ == "__main__":
    main()
