"""Calibration: is a confidence a probability? `tokentrail calibrate` scores a labelled
question set, reports how well each confidence measure separates right from wrong and
matches accuracy, and fits maps that turn a measure into the probability of being right.

- `data`: the labelled set (`Item`, `read_items`); `match`: when an answer is right;
- `measures`: the confidence measures of one answer; `metrics`: ECE, Brier, AUROC, PRR;
- `fit`: temperature scaling and isotonic maps; `apply`: `Calibration` (load, apply);
- `fingerprint`: which model a map belongs to; `answer`: getting answers in process or
  over HTTP; `run`: `calibrate(...)`, the library function behind the CLI; `report`:
  report.json, the reliability diagram, report.html, the table; `cli`: the command.

`Calibration` needs only the standard library; fitting and metrics need numpy and
scikit-learn (`pip install 'tokentrail[calibrate]'`), the diagram matplotlib.
"""

from __future__ import annotations

from .apply import Calibration
from .cli import register
from .data import Item, read_items
from .match import MATCH_RULES, is_correct, normalize
from .measures import MEASURES, SEGMENT_MEASURES

__all__ = [
    "MATCH_RULES",
    "MEASURES",
    "SEGMENT_MEASURES",
    "Calibration",
    "Item",
    "is_correct",
    "normalize",
    "read_items",
    "register",
]
