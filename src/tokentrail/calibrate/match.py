"""Whether a model's answer is right: the documented matching rules.

Every rule first normalises both texts (`normalize`): Unicode NFKC, case folded, every
punctuation or symbol character turned into a space, whitespace runs folded to one
space. Then:

- ``words`` (the default): an accepted answer's words appear, whole and in order, as
  consecutive words of the output ("Paris." and "It is Paris" match "paris"; "Parisian"
  does not);
- ``exact``: the output is an accepted answer;
- ``prefix``: the output starts with an accepted answer's words;
- ``contains``: an accepted answer is a substring of the output (no word boundaries).

A constrained choice is always matched ``exact``.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence

from ..errors import CalibrationError

__all__ = ["MATCH_RULES", "is_correct", "normalize"]


def normalize(text: str) -> str:
    """NFKC, casefold, punctuation and symbols to spaces, whitespace folded."""
    text = unicodedata.normalize("NFKC", text).casefold()
    kept = [" " if unicodedata.category(ch)[0] in "PSZC" else ch for ch in text]
    return " ".join("".join(kept).split())


def _words(out: str, ans: str) -> bool:
    return f" {ans} " in f" {out} "


def _exact(out: str, ans: str) -> bool:
    return out == ans


def _prefix(out: str, ans: str) -> bool:
    return f"{out} ".startswith(f"{ans} ")


def _contains(out: str, ans: str) -> bool:
    return ans in out


#: Rule name → test on normalised (output, answer).
MATCH_RULES: dict[str, Callable[[str, str], bool]] = {
    "words": _words,
    "exact": _exact,
    "prefix": _prefix,
    "contains": _contains,
}


def is_correct(output: str, answers: Sequence[str], rule: str = "words") -> bool:
    """Whether `output` matches any of `answers` under `rule` (see the module docstring).
    An answer that normalises to nothing never matches."""
    try:
        test = MATCH_RULES[rule]
    except KeyError:
        raise CalibrationError(
            f"unknown match rule {rule!r}; choose from {', '.join(MATCH_RULES)}"
        ) from None
    out = normalize(output)
    return any(a and test(out, a) for a in (normalize(x) for x in answers))
