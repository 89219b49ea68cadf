"""`tokentrail calibrate` end to end on the demo model: in process, through our own
server (--url), --resume, --fit then --calibration, the bad-input contract, and
`stream_generate(calibration=...)`.

report.json is checked against an independent recomputation from items.jsonl
(scikit-learn's AUROC and Brier, a plain loop for ECE), so the report cannot drift from
the answers it claims to summarise.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm", reason="the demo model runs on MLX: pip install -e '.[mlx]'")
pytest.importorskip("sklearn", reason="pip install -e '.[calibrate]'")
pytest.importorskip("llguidance", reason="choices are constrained: pip install -e '.[constrain]'")

import tokentrail
from tests.helpers.calibration_report import check_report_against_items
from tokentrail.calibrate import Calibration
from tokentrail.calibrate.fingerprint import model_fingerprint
from tokentrail.calibrate.fit import fit_calibration
from tokentrail.cli import main
from tokentrail.errors import CalibrationError

QUESTIONS = ["Is a list mutable?", "Is a tuple mutable?", "Is None a keyword?",
             "Is 3 an int?", "Does print return None?", "Is a dict ordered?"]


def write_set(path: Path) -> Path:
    """Choices the demo model picks between (answers alternate, so some are right and
    some wrong) and free-text questions it cannot answer."""
    lines = [{"id": f"c{i}", "messages": [{"role": "user", "content": q}],
              "answer": "yes" if i % 2 else "no", "choices": ["yes", "no"]}
             for i, q in enumerate(QUESTIONS)]
    lines += [{"id": "f1", "prompt": "def", "answer": ["return", "self"]},
              {"id": "f2", "messages": [{"role": "user", "content": "What is a str?"}],
               "answer": "a string"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def write_big_set(tmp_path: Path) -> Path:
    """`write_set`'s questions and six of its choices again under new ids: fourteen
    answers, enough to fit (10 per measure)."""
    lines = write_set(tmp_path / "set.jsonl").read_text().splitlines()
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(lines + [x.replace('"id": "c', '"id": "d') for x in lines[:6]]))
    return big


def run_cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["calibrate", *args, "--max-tokens", "6", "--bootstrap", "50", "--quiet"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def demo() -> tuple[object, object]:
    return tokentrail.load()


def test_calibrate_demo_model_end_to_end_and_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_set(tmp_path / "set.jsonl")
    out = tmp_path / "out"
    code, _, err = run_cli(str(data), "--out", str(out), "--limit", "5", capsys=capsys)
    assert code == 0, err
    check_report_against_items(out, 5)
    for name in ("reliability.png", "reliability.svg", "report.html"):
        assert (out / name).stat().st_size > 0
    rows = {json.loads(x)["id"]: json.loads(x) for x in (out / "items.jsonl").open()}
    assert all(r["output"] in ("yes", "no") for r in rows.values())  # constrained
    for r in rows.values():  # the decoded choice's share of the two choices' probability
        assert 0.0 < r["measures"]["field_prob"] < 1.0
    # a second run in the same folder without --resume would overwrite: refused
    code, _, err = run_cli(str(data), "--out", str(out), capsys=capsys)
    assert code == 2 and "--resume" in err and err.count("\n") == 1
    # an interrupted run: a line cut short at the end, then --resume
    lines = (out / "items.jsonl").read_text().splitlines()
    (out / "items.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])
    code, _, err = run_cli(str(data), "--out", str(out), "--resume", capsys=capsys)
    assert code == 0, err
    report = check_report_against_items(out, 8)
    after = {json.loads(x)["id"]: json.loads(x) for x in (out / "items.jsonl").open()}
    for qid in list(rows)[:3]:  # kept, not scored again
        assert after[qid]["measures"] == rows[qid]["measures"]
    assert report["primary"] != "calibrated"


def test_calibrate_through_our_server(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      demo: tuple[object, object]) -> None:
    """`calibrate --url` against `tokentrail serve --calibration`: the same answers and
    measures as in process, and the server's segments carry `calibrated`."""
    import httpx

    from tests.helpers.servers import start_server

    model, tokenizer = demo
    cal_path = tmp_path / "cal.json"
    cal_path.write_text(json.dumps(_fitted(model_fingerprint(model, tokenizer))))
    data = write_set(tmp_path / "set.jsonl")
    server = start_server(None, tmp_path / "server.log", "--calibration", str(cal_path))
    try:
        code, _, err = run_cli(str(data), "--out", str(tmp_path / "url"), "--url", server.url,
                               capsys=capsys)
        reply = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": server.model, "prompt": "def", "max_tokens": 4}).json()
    finally:
        server.stop()
    segments = reply["tokentrail"]["segments"]
    assert segments
    cal = Calibration.load(cal_path)
    for seg in segments:
        conf = seg["confidence"]
        assert conf["calibrated"] == pytest.approx(
            cal.map(cal.segment_measure, math.exp(conf["mean_logprob"])
                    if cal.segment_measure == "geo_prob" else conf["probability"]), rel=1e-6)
    assert code == 0, err
    check_report_against_items(tmp_path / "url", 8)
    code, _, err = run_cli(str(data), "--out", str(tmp_path / "local"), capsys=capsys)
    assert code == 0, err
    over_http = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "url/items.jsonl").open()}
    local = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "local/items.jsonl").open()}
    for qid, r in local.items():  # greedy, same model: same answers, same measures
        assert over_http[qid]["output"] == r["output"], qid
        for name, v in r["measures"].items():
            if v is None:
                assert over_http[qid]["measures"][name] is None
            else:
                assert over_http[qid]["measures"][name] == pytest.approx(v, rel=1e-3, abs=1e-6)


def test_a_server_that_constrains_no_choice_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`mlx_lm.server` takes neither vLLM's `structured_outputs` nor llama-server's
    `grammar`: its free answers must not be scored as choices. The probe finds that it
    obeys neither, and the run stops with exit 2 and one line saying so."""
    from tests.helpers.env import require
    from tests.helpers.net import free_port
    from tests.helpers.servers import DEMO_MODEL, launch

    require("mlx_lm", "mlx_lm.server")
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(DEMO_MODEL),
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    server = launch(cmd, tmp_path / "mlx.log", f"http://127.0.0.1:{port}", path="/v1/models",
                    any_status=True)  # fmt: skip
    try:
        lines = write_set(tmp_path / "set.jsonl").read_text().splitlines()
        choices = tmp_path / "choices.jsonl"  # chat questions with choices alone
        choices.write_text("".join(x + "\n" for x in lines if '"choices"' in x))
        code, _, err = run_cli(str(choices), "--out", str(tmp_path / "out"), "--url", server.url,
                               "--model", str(DEMO_MODEL), capsys=capsys)  # its model's id
    finally:
        server.stop()
    assert code == 2 and err.count("\n") == 1, err
    assert "does not constrain an answer to given choices" in err, err


def _fitted(fingerprint: dict) -> dict:
    """A calibration fitted on synthetic answers (the demo model gets too few right to
    fit on), with `fingerprint`."""
    rows = [{"id": str(i), "output": "", "correct": i % 3 == 0,
             "measures": {"geo_prob": (i % 10) / 10 + 0.05, "field_prob": 0.5 + (i % 5) / 10}}
            for i in range(60)]
    return fit_calibration(rows, fingerprint, {"data": "synthetic"}).to_dict()


def test_calibration_applies_to_calibrate_and_stream_generate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], demo: tuple[object, object]
) -> None:
    model, tokenizer = demo
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_fitted(model_fingerprint(model, tokenizer))))
    data = write_set(tmp_path / "set.jsonl")
    code, _, err = run_cli(str(data), "--out", str(tmp_path / "o"), "--limit", "3",
                           "--calibration", str(path), capsys=capsys)
    assert code == 0, err
    report = check_report_against_items(tmp_path / "o", 3)
    assert report["primary"] == "calibrated"
    cal = Calibration.load(path)
    for line in (tmp_path / "o/items.jsonl").open():
        r = json.loads(line)
        assert r["calibrated"] == pytest.approx(cal.answer(r["measures"])[0])
    seen = 0
    for r in tokentrail.stream_generate(model, tokenizer, "def", max_tokens=5,
                                        calibration=str(path)):
        if r.confidence is not None:
            seen += 1
            assert r.confidence.calibrated == pytest.approx(cal.segment(r.confidence))
            assert r.to_dict()["confidence"]["calibrated"] == r.confidence.calibrated
    assert seen
    # the same through `tokentrail generate --calibration`
    assert main(["generate", "--json", "--no-chat", "--max-tokens", "4", "--calibration",
                 str(path), "def"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    confs = [x["confidence"] for x in lines if x["confidence"] is not None]
    assert confs and all(0.0 <= c["calibrated"] <= 1.0 for c in confs)


def test_calibration_for_another_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], demo: tuple[object, object]
) -> None:
    model, tokenizer = demo
    other = dict(model_fingerprint(model, tokenizer), weights="0" * 64, name="other-model")
    path = tmp_path / "other.json"
    path.write_text(json.dumps(_fitted(other)))
    with pytest.raises(CalibrationError, match="fitted for another model"):
        tokentrail.stream_generate(model, tokenizer, "def", max_tokens=2, calibration=str(path))
    data = write_set(tmp_path / "set.jsonl")
    code, _, err = run_cli(str(data), "--out", str(tmp_path / "o"), "--calibration", str(path),
                           capsys=capsys)
    assert code == 2 and "fitted for another model" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--max-tokens", "2", "--calibration", str(path), "def"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "fitted for another model" in err and err.count("\n") == 1


def test_without_matplotlib_the_run_says_it_drew_no_diagram(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """matplotlib is an optional extra: without it the scores and the page are still
    written, and a warning says the diagram is missing and how to get it."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # its import now fails
    data = write_set(tmp_path / "set.jsonl")
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="tokentrail.calibrate"):
        code, _, err = run_cli(str(data), "--out", str(out), "--limit", "2", capsys=capsys)
    assert code == 0, err
    check_report_against_items(out, 2)
    assert (out / "report.html").stat().st_size > 0
    assert not (out / "reliability.png").exists() and not (out / "reliability.svg").exists()
    said = [r.getMessage() for r in caplog.records if "matplotlib" in r.getMessage()]
    assert len(said) == 1 and "tokentrail[calibrate]" in said[0], said


def test_malformed_line_exits_2_with_one_line(tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"id": 1, "prompt": "a", "answer": "b"}\n{"id": 2, "prompt": "a"}\n')
    r = subprocess.run([sys.executable, "-m", "tokentrail", "calibrate", str(data), "--out",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "line 2: answer is missing" in r.stderr
    assert not (tmp_path / "o").exists()  # nothing loaded, nothing written


def test_fit_writes_a_calibration_with_the_fingerprint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], demo: tuple[object, object]
) -> None:
    big = write_big_set(tmp_path)
    code, _, err = run_cli(str(big), "--out", str(tmp_path / "o"), "--fit",
                           str(tmp_path / "fit.json"), capsys=capsys)
    assert code == 0, err
    cal = Calibration.load(tmp_path / "fit.json")
    model, tokenizer = demo
    assert cal.fingerprint == model_fingerprint(model, tokenizer)
    assert cal.fitted_on["n"] == 14 and cal.fitted_on["data"] == "big.jsonl"
    assert cal.fitted_on["max_tokens"] == 6 and cal.fitted_on["top_logprobs"] == 5
    for spec in cal.maps.values():
        assert 0.0 <= cal.map(next(iter(cal.maps)), 0.5) <= 1.0
        assert spec["n"] >= 10
    assert not math.isnan(cal.answer({"geo_prob": 0.3})[0] or 0.0)


def test_fit_says_which_measure_and_whether_the_top_level_is_backed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], demo: tuple[object, object]
) -> None:
    """Without --quiet, --fit ends with one line on the map it saved: fourteen answers
    back no certainty (a ceiling needs n of n right with 0.05 ** (1 / n) >= 0.9, n >= 29)."""
    big, fit = write_big_set(tmp_path), tmp_path / "fit.json"
    code = main(["calibrate", str(big), "--out", str(tmp_path / "o"), "--max-tokens", "6",
                 "--bootstrap", "50", "--fit", str(fit)])
    out = capsys.readouterr().out
    assert code == 0
    line = out.strip().splitlines()[-1]
    cal = Calibration.load(fit)
    assert line.startswith(f"calibration saved to {fit}: answers use ")
    assert any(f"use {m} ({cal.maps[m]['kind']}" in line for m in cal.ranking)
    assert "most confident level (calibrated >= 0.9) is not backed by these answers" in line
    used = next(m for m in cal.ranking if f"use {m} (" in line)
    held = cal.maps[used].get("cv_ece")  # what the map is expected to show on unseen answers
    assert held is not None
    assert (f"cross-validated, its ECE is {held['ece']:.3f} where a calibrated measure "
            f"on these answers shows {held['if_calibrated']:.3f}") in line


def test_a_resume_that_would_decode_otherwise_is_refused_and_a_map_says_how_it_was_fitted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The measures are taken over the whole reply, so answers decoded with another
    length limit (or number of alternatives) are not like the ones kept: a resumed run
    that would mix them is refused (exit 2, one line naming the setting); a map fitted
    on answers decoded otherwise still applies, with a warning."""
    big = write_big_set(tmp_path)
    out, fit = tmp_path / "o", tmp_path / "fit.json"

    def cli(*args: str) -> tuple[int, str]:
        code = main(["calibrate", str(big), "--out", str(out), "--bootstrap", "20", "--quiet",
                     *args])
        return code, capsys.readouterr().err

    code, err = cli("--max-tokens", "4", "--limit", "5", "--fit", str(fit))
    assert code == 2 and "too few" in err  # five answers cannot be fitted; they are kept
    run = json.loads((out / "run.json").read_text())
    assert run["max_tokens"] == 4 and run["top_logprobs"] == 5 and run["model"]["weights"]
    kept = (out / "items.jsonl").read_text()
    for other in (["--max-tokens", "5"], ["--max-tokens", "4", "--top-logprobs", "3"]):
        code, err = cli("--resume", *other)
        assert code == 2 and err.count("\n") == 1, err
        assert ("max_tokens 4" if other[1] == "5" else "top_logprobs 5") in err, err
        assert (out / "items.jsonl").read_text() == kept  # nothing added, nothing lost
    code, err = cli("--resume", "--max-tokens", "4", "--fit", str(fit))
    assert code == 0, err
    assert len((out / "items.jsonl").read_text().splitlines()) == 14
    assert Calibration.load(fit).fitted_on["max_tokens"] == 4
    # Applied to answers decoded with another limit: a warning naming both, and the run.
    caplog.set_level(logging.WARNING, logger="tokentrail.calibrate.run")
    code, err = cli("--max-tokens", "6", "--calibration", str(fit), "--out", str(tmp_path / "p"))
    assert code == 0, err
    said = [r.getMessage() for r in caplog.records if "fitted on answers" in r.getMessage()]
    assert said == [
        "the calibration was fitted on answers decoded with max_tokens 4; this run decodes "
        "with max_tokens 6, so its measures may not match the map's"
    ]
    caplog.clear()
    code, err = cli("--max-tokens", "4", "--calibration", str(fit), "--out", str(tmp_path / "q"))
    assert code == 0 and not [r for r in caplog.records if "fitted on" in r.getMessage()]
