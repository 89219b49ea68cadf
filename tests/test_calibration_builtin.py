"""The calibration that ships with tokentrail: ``--calibration smollm2``.

`tokentrail/calibrate/maps/smollm2.json` was written by `tokentrail calibrate
benchmarks/data/calibration/atlas.jsonl --fit ... --engine llamacpp --model smollm2`
(docs/calibration.md): maps for SmolLM2-135M-Instruct Q4_1 on llama.cpp, fitted on the
broad real set, whose maps transfer to sets they never saw
(benchmarks/results/calibration.md). It must name the data it was fitted on exactly (so
that a changed set shows it is stale), belong to the real model by fingerprint, work by
name wherever a calibration file does, and be refused for any other model.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

import tokentrail
from tokentrail.calibrate import Calibration
from tokentrail.calibrate.apply import builtin_calibrations
from tokentrail.calibrate.fingerprint import calibration_for, file_digest
from tokentrail.calibrate.run import calibrate
from tokentrail.cli import main
from tokentrail.errors import CalibrationError
from tokentrail.segment import probability_level

ATLAS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "calibration" / "atlas.jsonl"


def test_the_builtin_map_names_the_set_it_was_fitted_on() -> None:
    assert "smollm2" in builtin_calibrations()
    cal = Calibration.load("smollm2")
    on = cal.fitted_on
    assert on["data"] == ATLAS.name and on["part"] is None
    assert on["sha256"] == hashlib.sha256(ATLAS.read_bytes()).hexdigest(), (
        "atlas.jsonl changed: refit the built-in map (docs/calibration.md)"
    )
    assert on["n"] == len(ATLAS.read_text("utf-8").splitlines())
    # Fitted on answers decoded as `tokentrail calibrate` decodes them by default: the
    # measures are taken over the whole reply, so its length limit shapes them (on atlas,
    # a map fitted on 16-token replies gave 0.109 on knowledge.jsonl's 32-token ones, the
    # map fitted on 32-token replies 0.093).
    defaults = inspect.signature(calibrate).parameters
    assert on["max_tokens"] == defaults["max_tokens"].default
    assert on["top_logprobs"] == defaults["top_logprobs"].default
    assert cal.fingerprint["engine"] == "llamacpp" and cal.segment_measure is not None
    # On atlas.jsonl the tokens' geometric mean (what `level` is cut on) states 0.50 on
    # average where 41% of the answers are right, and the product of a sentence's token
    # probabilities 0.03: the map lowers the one and raises the other; every map keeps
    # the order of its measure.
    assert cal.map("geo_prob", 0.5) < 0.45 and cal.map("prob", 0.03) > 0.3
    grid = [i / 20 for i in range(1, 20)]
    for name in cal.maps:
        if name != "field_prob":
            mapped = [cal.map(name, v) for v in grid]
            assert mapped == sorted(mapped) and all(0 < p < 1 for p in mapped), name


def test_an_unknown_name_is_an_error_naming_the_builtin_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(CalibrationError, match=r"no built-in calibration.*smollm2"):
        Calibration.load("smollm3")
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--max-tokens", "2", "--calibration", "smollm3", "def"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "smollm3" in err and err.count("\n") == 1


def test_the_builtin_map_is_refused_for_another_model(demo: tuple[Any, Any]) -> None:
    model, tokenizer = demo
    with pytest.raises(CalibrationError, match="fitted for another model"):
        calibration_for("smollm2", model, tokenizer)


def test_the_builtin_map_calibrates_smollm2_on_llamacpp(smollm2_gguf: Path, llama_cpp: Any) -> None:
    cal = Calibration.load("smollm2")
    assert cal.fingerprint["weights"] == file_digest(smollm2_gguf)
    model, tokenizer = tokentrail.load(str(smollm2_gguf), engine="llamacpp")
    assert calibration_for(cal, model, tokenizer) is cal  # its own model: accepted
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    seen = []
    for r in tokentrail.stream_generate(model, tokenizer, messages, max_tokens=8,
                                        calibration="smollm2"):
        if r.confidence is not None:
            c = r.confidence
            seen.append(c)
            assert c.calibrated is not None and 0.0 <= c.calibrated <= 1.0
            assert c.level == probability_level(c.calibrated)  # the level follows it
            assert json.loads(json.dumps(c.to_dict()))["calibrated"] == c.calibrated
    assert seen


def test_a_freed_model_leaves_no_check_another_could_pass_for(
    smollm2_gguf: Path, llama_cpp: Any, demo: tuple[Any, Any]
) -> None:
    """A calibration remembers which models passed its fingerprint check by the objects,
    weakly: once the checked model is freed nothing of it is left, so another model
    that CPython places at the same addresses is checked afresh and refused. (The check
    was remembered by `id(model), id(tokenizer)`, which a later model can take over.)"""
    import gc

    cal = Calibration.load("smollm2")
    model, tokenizer = tokentrail.load(str(smollm2_gguf), engine="llamacpp")
    assert calibration_for(cal, model, tokenizer) is cal
    assert calibration_for(cal, model, tokenizer) is cal  # remembered: the same answer
    del model, tokenizer
    gc.collect()
    assert len(cal.checked) == 0
    other, other_tokenizer = demo
    with pytest.raises(CalibrationError, match="fitted for another model"):
        calibration_for(cal, other, other_tokenizer)


def test_an_mlx_model_is_checked_once_and_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """An MLX module is a dict (it cannot be a weak dictionary's key): the check is still
    made once per model and tokenizer, not on every request (the fingerprint hashes the
    model's parameters), and is let go with the model."""
    import dataclasses
    import gc

    from tokentrail.calibrate import fingerprint

    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
    model, tokenizer = tokentrail.load(None, engine="mlx")  # the built-in demo model
    cal = Calibration.load("smollm2")
    cal = dataclasses.replace(cal, fingerprint=fingerprint.model_fingerprint(model, tokenizer))
    made: list[int] = []
    real = fingerprint.model_fingerprint

    def counted(*args: Any, **kwargs: Any) -> dict[str, Any]:
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fingerprint, "model_fingerprint", counted)
    for _ in range(3):
        assert calibration_for(cal, model, tokenizer) is cal
    assert len(made) == 1
    del model, tokenizer
    gc.collect()
    assert len(cal.checked) == 0


def test_generate_takes_the_builtin_map_by_name(
    smollm2_gguf: Path, llama_cpp: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["generate", "--engine", "llamacpp", "--model", str(smollm2_gguf),
                 "--calibration", "smollm2", "--max-tokens", "4", "--json", "Capital of Peru?"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    confs = [x["confidence"] for x in lines if x.get("confidence")]
    assert code == 0 and confs
    assert all(0.0 <= c["calibrated"] <= 1.0 and c["level"] == probability_level(c["calibrated"])
               for c in confs)
