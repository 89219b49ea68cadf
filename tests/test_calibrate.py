"""tokentrail.calibrate's parts on their own: metrics against scikit-learn and hand-worked
cases, the match rules, the data checks, fitting and applying maps, fingerprints.

The model runs are in tests/test_calibrate_cli.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("sklearn", reason="pip install -e '.[calibrate]'")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sklearn.metrics import brier_score_loss, roc_auc_score  # noqa: E402

from tokentrail.calibrate import Calibration, is_correct, normalize, read_items  # noqa: E402
from tokentrail.calibrate.apply import apply_map, check_fingerprint  # noqa: E402
from tokentrail.calibrate.fit import fit_calibration, fit_map, log_loss  # noqa: E402
from tokentrail.calibrate.measures import (  # noqa: E402
    TokenRecord,
    choice_probability,
    measures_of,
    segment_measures,
)
from tokentrail.calibrate.metrics import (  # noqa: E402
    auroc,
    brier,
    ece,
    ece_equal_mass,
    prr,
    summarize,
)
from tokentrail.errors import CalibrationError  # noqa: E402
from tokentrail.segment import Confidence, confidence_of  # noqa: E402

probs = st.lists(st.floats(0, 1, allow_nan=False), min_size=2, max_size=60)


# -- metrics -----------------------------------------------------------------------------

def test_ece_by_hand() -> None:
    # bin [0.2, 0.3): two answers at 0.25, one right -> |0.5 - 0.25| * 2/4
    # bin [0.9, 1.0]: 0.9 and 1.0, both right -> |1 - 0.95| * 2/4
    conf, y = [0.25, 0.25, 0.9, 1.0], [1, 0, 1, 1]
    assert ece(conf, y) == pytest.approx(0.25 * 0.5 + 0.05 * 0.5)
    # equal mass, 2 bins: {0.25, 0.25} and {0.9, 1.0}: the same figure here
    assert ece_equal_mass(conf, y, bins=2) == pytest.approx(0.25 * 0.5 + 0.05 * 0.5)
    assert ece([0.1, 0.3], [0, 1]) == pytest.approx((0.1 + 0.7) / 2)


def test_equal_mass_bins_keep_equal_confidences_together() -> None:
    # ten answers at two figures (a binned map says few): four quantile bins cut at
    # 0.2, 0.4, 0.6; the five at 0.2 (one right) and the five at 0.6 (four right) each
    # stay whole: |0.2 - 0.2| * 0.5 + |0.8 - 0.6| * 0.5
    conf = [0.2] * 5 + [0.6] * 5
    y = [1, 0, 0, 0, 0, 1, 1, 1, 0, 1]
    assert ece_equal_mass(conf, y, bins=4) == pytest.approx(0.1)
    # the answers' order changes nothing (splitting the ties in file order did)
    assert ece_equal_mass(conf[::-1], y[::-1], bins=4) == pytest.approx(0.1)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.data())
def test_equal_mass_ece_agrees_with_sklearns_quantile_bins(m: int, data: st.DataObject) -> None:
    """Distinct confidences, ten bins of m answers each: the figure is the mean over
    scikit-learn's quantile bins of |accuracy - mean confidence|."""
    from sklearn.calibration import calibration_curve

    # (distinct and apart: scikit-learn's quantile edges of 0 and 5e-324 coincide)
    conf = [k / 10_000 for k in data.draw(st.lists(st.integers(0, 10_000), min_size=10 * m,
                                                   max_size=10 * m, unique=True))]
    y = data.draw(st.lists(st.integers(0, 1), min_size=10 * m, max_size=10 * m))
    if len(set(y)) < 2:  # scikit-learn wants both outcomes
        y[0] = 1 - y[0]
    right, said = calibration_curve(y, conf, n_bins=10, strategy="quantile")
    assert len(right) == 10
    assert ece_equal_mass(conf, y) == pytest.approx(float(np.mean(np.abs(right - said))))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.1, 0.35, 0.5, 0.9]), min_size=2, max_size=60),
       st.data())
def test_tied_confidences_give_figures_independent_of_order(
    conf: list[float], data: st.DataObject
) -> None:
    y = data.draw(st.lists(st.integers(0, 1), min_size=len(conf), max_size=len(conf)))
    perm = data.draw(st.permutations(range(len(conf))))
    c2, y2 = [conf[i] for i in perm], [y[i] for i in perm]
    assert ece_equal_mass(c2, y2) == pytest.approx(ece_equal_mass(conf, y), abs=1e-12)
    a, b = prr(conf, y), prr(c2, y2)
    assert (a is None and b is None) or a == pytest.approx(b, abs=1e-12)


def test_prr_by_hand() -> None:
    y = [1, 0, 1, 0]
    assert prr([0.9, 0.1, 0.8, 0.2], y) == pytest.approx(1.0)  # rejects the wrong first
    assert prr([0.1, 0.9, 0.2, 0.8], y) == pytest.approx(-1.0)  # rejects the right first
    # kept curves (k = 4..1): measure order rejects 0.1 (y=1) first
    conf = [0.1, 0.2, 0.3, 0.4]
    y2 = [1, 0, 0, 1]
    measure = np.mean([1 / 1, 1 / 2, 1 / 3, 2 / 4])  # most confident first: 1,0,0,1
    oracle = np.mean([1, 1, 2 / 3, 2 / 4])
    assert prr(conf, y2) == pytest.approx((measure - 0.5) / (oracle - 0.5))
    # one confidence for all: no better than random rejection, in any order
    assert prr([0.5] * 4, [1, 1, 0, 0]) == 0.0 == prr([0.5] * 4, [0, 0, 1, 1])
    # ties within a measure count as rejected in random order: {0.2: y 0, 1} rejected
    # first as a pair of mean 0.5, then 0.9 (y 1); kept curves k = 3, 2, 1: 2/3, 3/4, 1
    expected = np.mean([2 / 3, (1 + 0.5) / 2, 1.0])
    assert prr([0.2, 0.2, 0.9], [0, 1, 1]) == pytest.approx(
        (expected - 2 / 3) / (np.mean([2 / 3, 1.0, 1.0]) - 2 / 3))


@settings(max_examples=60, deadline=None)
@given(probs, st.data())
def test_auroc_and_brier_agree_with_sklearn(conf: list[float], data: st.DataObject) -> None:
    y = data.draw(st.lists(st.integers(0, 1), min_size=len(conf), max_size=len(conf)))
    assert brier(conf, y) == pytest.approx(brier_score_loss(y, conf), abs=1e-12)
    if 0 < sum(y) < len(y):
        assert auroc(conf, y) == pytest.approx(roc_auc_score(y, conf), abs=1e-12)
    else:
        assert auroc(conf, y) is None


@settings(max_examples=60, deadline=None)
@given(probs, st.data())
def test_ece_is_a_weighted_gap_within_bounds(conf: list[float], data: st.DataObject) -> None:
    y = data.draw(st.lists(st.integers(0, 1), min_size=len(conf), max_size=len(conf)))
    # independent computation: loop over equal-width bins
    total = 0.0
    for b in range(10):
        members = [i for i, c in enumerate(conf) if min(int(c * 10), 9) == b]
        if members:
            gap = sum(y[i] for i in members) / len(members) - sum(conf[i] for i in members) / len(
                members)
            total += abs(gap) * len(members) / len(conf)
    assert ece(conf, y) == pytest.approx(total, abs=1e-9)
    assert 0.0 <= ece_equal_mass(conf, y) <= 1.0
    # a confidence equal to the outcome is perfectly calibrated and separating
    assert ece(y, y) == 0.0 and brier(y, y) == 0.0


def test_summarize_intervals_hold_the_figures() -> None:
    rng = np.random.default_rng(3)
    conf = rng.random(300)
    y = (rng.random(300) < conf).astype(int)
    s = summarize(conf, y, n_boot=200, seed=1)
    assert s["n"] == 300
    for name in ("brier", "auroc", "prr"):
        lo, hi = s["ci95"][name]
        assert lo <= s[name] <= hi, name
    assert s == summarize(conf, y, n_boot=200, seed=1)  # seeded: reproducible


# -- measures ----------------------------------------------------------------------------

def test_measures_by_hand() -> None:
    tokens = [TokenRecord(math.log(0.5), (math.log(0.5), math.log(0.3))),
              TokenRecord(math.log(0.8), (math.log(0.8), math.log(0.2)))]
    m = measures_of(tokens)
    assert m["prob"] == pytest.approx(0.4)
    assert m["geo_prob"] == pytest.approx(math.sqrt(0.4))
    assert m["first_prob"] == pytest.approx(0.5)
    assert m["min_prob"] == pytest.approx(0.5)
    assert m["margin"] == pytest.approx(((0.5 - 0.3) + (0.8 - 0.2)) / 2)
    h1 = -(0.625 * math.log(0.625) + 0.375 * math.log(0.375))
    h2 = -(0.8 * math.log(0.8) + 0.2 * math.log(0.2))
    assert m["exp_neg_entropy"] == pytest.approx(math.exp(-(h1 + h2) / 2))
    assert m["level"] == 0.5  # geometric mean 0.63: two of 0.2/0.45/0.7/0.9
    assert m["field_prob"] is None
    assert measures_of([])["prob"] is None


def test_segment_measures_match_answer_measures() -> None:
    """A segment's Confidence gives the same figures as the answer measures."""
    from tokentrail.segment import Alternative, TokenSpan

    spans = [TokenSpan(0, 1, 0, 1, math.log(0.5), (Alternative(1, math.log(0.5), b"a", "a"),
                                                   Alternative(2, math.log(0.3), b"b", "b"))),
             TokenSpan(1, 2, 0, 1, math.log(0.8), (Alternative(2, math.log(0.8), b"b", "b"),))]
    conf = confidence_of(spans)
    assert conf is not None
    seg = segment_measures(conf)
    ans = measures_of([TokenRecord(t.logprob, tuple(a.logprob for a in t.top_logprobs))
                       for t in spans])
    for name, v in seg.items():
        assert v == pytest.approx(ans[name]), name


def test_choice_probability_is_a_softmax() -> None:
    scores = {"a": math.log(0.2), "b": math.log(0.6)}
    assert choice_probability(scores, "b") == pytest.approx(0.75)
    assert choice_probability(scores, "c") is None
    assert choice_probability({"a": -math.inf, "b": -1.0}, "a") == 0.0


# -- matching ------------------------------------------------------------------------------

@pytest.mark.parametrize(("output", "answers", "rule", "right"), [
    ("The capital is Paris.", ["Paris"], "words", True),
    ("Parisian food", ["Paris"], "words", False),
    ("Parisian food", ["Paris"], "contains", True),
    ("ＰＡＲＩＳ!", ["paris"], "exact", True),  # NFKC folds full-width letters
    ("Washington, D.C. is it", ["Washington, D.C."], "prefix", True),
    ("It is Washington D C", ["Washington, D.C."], "words", True),
    ("Bogotá", ["Bogota"], "words", False),  # accents are kept: list both spellings
    ("Straße", ["STRASSE"], "exact", True),  # casefold, not lower
    ("4", ["14"], "words", False),
])
def test_match_rules(output: str, answers: list[str], rule: str, right: bool) -> None:
    assert is_correct(output, answers, rule) is right


def test_normalize_and_unknown_rule() -> None:
    assert normalize("  Hello,\tWORLD!! ") == "hello world"
    with pytest.raises(CalibrationError, match="unknown match rule"):
        is_correct("a", ["a"], "fuzzy")


# -- data ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("line", "message"), [
    ("not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"prompt": "q", "answer": "a"}', "id must be"),
    ('{"id": 1, "answer": "a"}', "exactly one of messages and prompt"),
    ('{"id": 1, "prompt": "q"}', "answer is missing"),
    ('{"id": 1, "prompt": "q", "answer": []}', "answer must be"),
    ('{"id": 1, "messages": [{"role": "user"}], "answer": "a"}', "each message"),
    ('{"id": 1, "prompt": "q", "answer": "a", "choices": ["b", "c"]}', "among the choices"),
    ('{"id": 1, "prompt": "q", "answer": "a", "choices": ["a", "a"]}', "two distinct"),
    ('{"id": "q1", "prompt": "q", "answer": "a"}', "repeats line 1"),
    ('{"id": 1, "prompt": "q", "answer": true}', "answer must be a string, a number"),
    ('{"id": 1, "prompt": "q", "answer": [4, null]}', "non-empty strings or numbers, got None"),
    ('{"id": 1, "prompt": "q", "answer": 1e999}', "got inf"),
])
def test_bad_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "q1", "prompt": "q", "answer": "a"}\n\n' + line + "\n")
    with pytest.raises(CalibrationError, match=message) as err:
        read_items(data)
    assert err.value.line == 3
    assert str(err.value).startswith("line 3:")


def test_numbers_stand_for_their_text(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    lines = ['{"id": 1, "prompt": "6 * 7 =", "answer": 42}',
             '{"id": 2, "prompt": "9 / 2 =", "answer": [4.5, "four and a half"]}',
             '{"id": 3, "prompt": "2 + 2 =", "answer": 4.0, "choices": [3, 4, 5]}']
    data.write_text("\n".join(lines) + "\n")
    a, b, c = read_items(data)
    assert a.answers == ("42",) and b.answers == ("4.5", "four and a half")
    assert c.answers == ("4",) and c.choices == ("3", "4", "5")
    assert is_correct("The answer is 42.", a.answers, "words")
    assert not is_correct("The answer is 420.", a.answers, "words")


def test_a_byte_order_mark_and_crlf_line_ends_are_read_past(tmp_path: Path) -> None:
    # As a Windows editor or a spreadsheet export saves JSON Lines (the stdlib's json
    # refuses a BOM: "Unexpected UTF-8 BOM"); a BOM anywhere but the start is still text.
    data = tmp_path / "d.jsonl"
    lines = ['{"id": 1, "prompt": "q", "answer": "a"}', '{"id": 2, "prompt": "r", "answer": "b"}']
    data.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    assert [(i.id, i.prompt, i.answers, i.line) for i in read_items(data)] == [
        ("1", "q", ("a",), 1), ("2", "r", ("b",), 2)]
    data.write_bytes(lines[0].encode() + b"\n\xef\xbb\xbf" + lines[1].encode() + b"\n")
    with pytest.raises(CalibrationError, match="line 2: not JSON"):
        read_items(data)


def test_shipped_sets_read(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "calibration"
    facts = read_items(root / "facts.jsonl")
    arith = read_items(root / "arithmetic.jsonl")
    assert len(facts) + len(arith) >= 400
    assert any(i.choices for i in facts)
    for item in arith:  # the generated answers are right
        q = item.prompt[-1]["content"]
        a, op, b = q.removeprefix("What is ").rstrip("?").split(" ")
        assert int(item.answers[0]) == (int(a) + int(b) if op == "+" else int(a) * int(b))


# -- fitting and applying ----------------------------------------------------------------------

def _rows(n: int, seed: int, squash: float = 3.0) -> list[dict]:
    """Scored answers whose geo_prob is overconfident: true p = geo_prob ** squash."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        g = float(rng.uniform(0.05, 0.99))
        rows.append({"id": str(i), "output": "", "correct": bool(rng.random() < g**squash),
                     "measures": {"geo_prob": g, "prob": g**2, "first_prob": None},
                     "calibrated": None})
    return rows


FP = {"name": "m", "engine": "mlx", "tokenizer": "t" * 64, "weights": "w" * 64}


def test_fit_improves_calibration_on_held_out_answers(tmp_path: Path) -> None:
    train, test = _rows(600, 1), _rows(600, 2)
    cal = fit_calibration(train, FP, {"data": "synthetic"})
    assert set(cal.maps) == {"geo_prob", "prob"}  # first_prob had no values
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal.to_dict()))
    back = Calibration.load(path)
    assert back.maps == cal.maps and back.ranking == cal.ranking
    conf_raw = [r["measures"]["geo_prob"] for r in test]
    y = [r["correct"] for r in test]
    conf_cal = [back.map("geo_prob", c) for c in conf_raw]
    assert ece(conf_cal, y) < 0.06 < ece(conf_raw, y)
    assert log_loss(conf_cal, y) < log_loss(conf_raw, y)
    assert back.segment_measure in ("geo_prob", "prob")


def test_fit_map_picks_by_cross_validated_log_loss() -> None:
    rng = np.random.default_rng(5)
    c = rng.uniform(0, 1, 400)
    # accuracy is a step of the measure: no logistic curve fits it, isotonic does
    y = (rng.random(400) < np.where(c > 0.5, 0.9, 0.1)).astype(int)
    spec = fit_map(c, y)
    assert spec["kind"] == "isotonic"
    assert spec["cv_log_loss"]["isotonic"] < spec["cv_log_loss"]["temperature"]
    # a measure that is a logistic function of its logit: temperature is as good or better
    c2 = rng.uniform(0.01, 0.99, 400)
    y2 = (rng.random(400) < c2).astype(int)
    assert fit_map(c2, y2)["kind"] == "temperature"


def _mixed(n: int, seed: int) -> list[dict]:
    """Free-text answers whose geo_prob is overconfident (true p = geo_prob ** 3) and
    constrained choices whose forced tokens are near-certain (prob 0.9-1) while they are
    right 30% of the time, whatever their `field_prob` says."""
    rng = np.random.default_rng(seed)
    rows = _rows(n, seed)
    for i in range(n):
        f = float(rng.uniform(0.3, 1.0))
        rows.append({"id": f"c{i}", "output": "", "correct": bool(rng.random() < 0.3),
                     "measures": {"geo_prob": float(rng.uniform(0.9, 1.0)),
                                  "prob": float(rng.uniform(0.9, 1.0)), "field_prob": f},
                     "calibrated": None})
    return rows


def test_choices_and_free_text_get_maps_of_their_own() -> None:
    train, test = _mixed(400, 11), _mixed(400, 12)
    cal = fit_calibration(train, FP, {"data": "synthetic"})
    assert cal.maps["field_prob"]["rows"] == "choice"
    assert cal.maps["geo_prob"]["rows"] == cal.maps["prob"]["rows"] == "free"
    # field_prob says nothing about being right here: the cross-validation picks the rate
    assert cal.maps["field_prob"]["kind"] == "constant"
    assert abs(cal.maps["field_prob"]["p"] - 0.3) < 0.08
    assert cal.segment_measure in ("geo_prob", "prob")
    for kind in (True, False):
        rows = [r for r in test if (r["measures"].get("field_prob") is not None) == kind]
        got = [cal.answer(r["measures"]) for r in rows]
        assert {m for _, m in got} <= ({"field_prob"} if kind else {"geo_prob", "prob"})
        assert ece([p for p, _ in got], [r["correct"] for r in rows]) < 0.07
    # one map over both kinds mistakes the choices' forced tokens for confidence: the
    # free-text answers it calls near-certain are pulled towards the choices' rate
    pooled = fit_map([r["measures"]["geo_prob"] for r in train], [r["correct"] for r in train])
    y = [r["correct"] for r in test]
    split = log_loss([cal.answer(r["measures"])[0] for r in test], y)
    one = log_loss([apply_map(pooled, r["measures"]["geo_prob"]) for r in test], y)
    sure = [r for r in test if "field_prob" not in r["measures"]
            and r["measures"]["geo_prob"] > 0.9]
    sure_y = [r["correct"] for r in sure]
    assert split < one
    assert ece([apply_map(pooled, r["measures"]["geo_prob"]) for r in sure], sure_y) > 0.15
    assert ece([cal.answer(r["measures"])[0] for r in sure], sure_y) < 0.1


def test_a_constant_map_for_choices_follows_the_number_of_choices() -> None:
    """Fitted on two-way questions right 60% of the time (skill 0.2 above guessing), the
    map says 0.25 + 0.75 * 0.2 = 0.4 for a four-way one, and the base rate for an answer
    whose number of choices it is not told."""
    rng = np.random.default_rng(3)
    free = _rows(50, 4)
    choice = [{"id": f"c{i}", "output": "", "correct": bool(rng.random() < 0.6),
               "measures": {"prob": 0.95, "field_prob": float(rng.uniform(0.5, 1)),
                            "chance": 0.5}, "calibrated": None} for i in range(600)]
    cal = fit_calibration(free + choice, FP, {"data": "synthetic"})
    spec = cal.maps["field_prob"]
    assert spec["kind"] == "constant" and abs(spec["skill"] - 0.2) < 0.06
    rate = float(np.mean([r["correct"] for r in choice]))
    four, _ = cal.answer({"prob": 0.95, "field_prob": 0.7, "chance": 0.25})
    two, _ = cal.answer({"prob": 0.95, "field_prob": 0.7, "chance": 0.5})
    untold, _ = cal.answer({"prob": 0.95, "field_prob": 0.7})
    assert abs(two - rate) < 0.01 and abs(four - (0.25 + 0.75 * spec["skill"])) < 1e-9
    assert four < two and abs(untold - spec["p"]) < 1e-9


def test_a_constant_map_for_choices_keeps_each_number_of_choices_own_rate() -> None:
    """Yes/no questions right 40% of the time (below guessing) beside four-way ones right
    45% (well above): one skill says 0.5 + 0.5 s and 0.25 + 0.75 s, wrong for both; each
    number of choices the fit saw gets its own rate, pooled with the skill's figure by
    `CHOICE_POOL` answers, and a number it never saw gets the skill."""
    from tokentrail.calibrate.fit import CHOICE_POOL

    rng = np.random.default_rng(9)
    rows = _rows(50, 4)  # free text beside them: the choices get a map of their own
    for k, rate, n in ((2, 0.4, 300), (4, 0.45, 300)):
        right = rng.permutation(np.arange(n) < round(rate * n))
        rows += [{"id": f"k{k}-{i}", "output": "", "correct": bool(right[i]),
                  "measures": {"prob": 0.9, "field_prob": float(rng.uniform(0.3, 1)),
                               "chance": 1.0 / k}, "calibrated": None} for i in range(n)]
    cal = fit_calibration(rows, FP, {"data": "synthetic"})
    spec = cal.maps["field_prob"]
    assert spec["kind"] == "constant"
    skill = spec["skill"]  # ((0.4 - 0.5) / 0.5 + (0.45 - 0.25) / 0.75) / 2
    assert skill == pytest.approx((-0.2 + 0.2 / 0.75) / 2)
    for k, rate in ((2, 0.4), (4, 0.45)):
        prior = 1 / k + (1 - 1 / k) * skill
        want = (rate * 300 + CHOICE_POOL * prior) / (300 + CHOICE_POOL)
        got, _ = cal.answer({"prob": 0.9, "field_prob": 0.6, "chance": 1 / k})
        assert got == pytest.approx(want) and abs(got - rate) < 0.01
    three, _ = cal.answer({"prob": 0.9, "field_prob": 0.6, "chance": 1 / 3})
    assert three == pytest.approx(1 / 3 + (2 / 3) * skill)


def test_isotonic_levels_are_smoothed_by_the_answers_behind_them() -> None:
    """Twelve answers above 0.9, all right: isotonic regression alone says 0.99 there
    (its ceiling); twelve answers are evidence for 13/14, not certainty."""
    from tokentrail.calibrate.fit import fit_kind

    rng = np.random.default_rng(8)
    low = rng.uniform(0.0, 0.5, 200)
    c = np.concatenate([low, rng.uniform(0.91, 0.99, 12)])
    y = np.concatenate([(rng.random(200) < 0.2).astype(float), np.ones(12)])
    spec = fit_kind("isotonic", c, y)
    assert spec["y"] == sorted(spec["y"])
    assert abs(apply_map(spec, 0.95) - 13 / 14) < 1e-9
    assert apply_map(spec, 0.95) > apply_map(spec, 0.2)


def test_one_class_gives_a_constant_map() -> None:
    spec = fit_map([0.1, 0.5, 0.9] * 5, [1] * 15)
    assert spec["kind"] == "constant" and 0.9 < spec["p"] < 1.0


def test_fingerprint_refusal_and_acceptance() -> None:
    check_fingerprint(FP, dict(FP))
    with pytest.raises(CalibrationError, match="fitted for another model"):
        check_fingerprint(FP, dict(FP, weights="x" * 64))
    with pytest.raises(CalibrationError, match="fitted for another model"):
        check_fingerprint(FP, dict(FP, tokenizer="x" * 64))
    url_fp = {"name": "served", "tokenizer": None, "weights": None}
    with pytest.raises(CalibrationError, match="'served', not 'other'"):
        check_fingerprint(url_fp, {"name": "other"})
    check_fingerprint(url_fp, dict(FP, name="served"))


def test_calibrated_confidence_sets_level_and_json() -> None:
    cal = Calibration.from_dict({
        "format": "tokentrail-calibration", "ranking": ["geo_prob"],
        "segment_measure": "geo_prob",
        "maps": {"geo_prob": {"kind": "isotonic", "x": [0.0, 1.0], "y": [0.0, 0.5]}},
    })
    conf = Confidence(math.log(0.96), math.log(0.96), 1 / 0.96, 0.96, None, 1)
    assert conf.level == 4 and "calibrated" not in conf.to_dict()  # shape unchanged
    conf.calibrated = cal.segment(conf)
    assert conf.calibrated == pytest.approx(0.48)
    assert conf.level == 2  # 0.48 reaches 0.2 and 0.45
    assert conf.to_dict()["calibrated"] == pytest.approx(0.48)


@pytest.mark.parametrize("bad", [
    {"format": "other"},
    {"format": "tokentrail-calibration", "maps": {}},
    {"format": "tokentrail-calibration", "maps": {"nope": {"kind": "constant", "p": 0.5}}},
    {"format": "tokentrail-calibration", "maps": {"prob": {"kind": "temperature"}}},
    {"format": "tokentrail-calibration", "maps": {"prob": {"kind": "isotonic", "x": [1, 0],
                                                           "y": [0, 1]}}},
    {"format": "tokentrail-calibration", "maps": {"field_prob": {
        "kind": "constant", "p": 0.4, "skill": 0.1, "by_k": {"two": 0.4}}}},
    {"format": "tokentrail-calibration", "maps": {"field_prob": {
        "kind": "constant", "p": 0.4, "skill": 0.1, "by_k": {"2": 1.5}}}},
])
def test_malformed_calibration_is_refused(tmp_path: Path, bad: dict) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(CalibrationError):
        Calibration.load(path)


# -- reading a server's reply --------------------------------------------------------------


def _entry(token: str, logprob: float | None, raw: list[int] | None = None) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()) if raw is None
            else raw, "top_logprobs": [{"token": token, "logprob": logprob, "bytes": []}]}


def test_an_end_token_without_a_logprob_is_left_out_and_the_answer_kept() -> None:
    """A server may stand in for an end token it was not sent (tokentrail's proxy does,
    with no logprob: null on the wire). The end entry is left out before any logprob is
    read: the answer keeps all its own tokens (before, the null was dropped first and
    then the answer's last real token was taken for the end)."""
    from tokentrail.calibrate.answer import chat_reply, completion_reply

    chat = {"message": {"content": "Paris"}, "finish_reason": "stop", "logprobs": {
        "content": [_entry("Par", -0.5), _entry("is", -0.25), _entry("", None, [])]}}
    text, tokens = chat_reply(chat)
    assert text == "Paris" and [t.logprob for t in tokens] == [-0.5, -0.25]
    completion = {"text": "Paris", "finish_reason": "stop", "logprobs": {
        "tokens": ["Par", "is", "<|im_end|>"], "token_logprobs": [-0.5, -0.25, None],
        "top_logprobs": [{"Par": -0.5}, {"is": -0.25}, None]}}
    text, tokens = completion_reply(completion)
    assert text == "Paris" and [t.logprob for t in tokens] == [-0.5, -0.25]


def test_an_answer_token_without_a_logprob_is_a_calibration_error() -> None:
    from tokentrail.calibrate.answer import chat_reply

    chat = {"message": {"content": "Paris"}, "finish_reason": "stop", "logprobs": {
        "content": [_entry("Par", None), _entry("is", -0.25)]}}
    with pytest.raises(CalibrationError, match="without its logprob"):
        chat_reply(chat)
