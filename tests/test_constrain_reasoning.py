"""A constraint after the reasoning, on every in-process engine (MLX, torch, llama.cpp;
solo and batch rows): the mask is off while the model reasons and starts once the
reasoning's end marker has been generated, as vLLM's structured outputs do.

The end marker is cut out of the model's own greedy, unconstrained output (two of its
tokens, decoded by the tokenizer): a string the model writes early. Oracles: the same
engine's unconstrained greedy run (the reasoning tokens must be exactly its tokens),
`jsonschema` for the content after the marker, and the tokenizer's decode for where the
marker ends.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers.rigs import ENGINES, LIMIT, Rig, chat_ids, drain, open_rig
from tests.test_constrain import SCHEMAS

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")

from tokentrail.constrain import constraint_from  # noqa: E402


@pytest.fixture(scope="module", params=ENGINES)
def rig(request: pytest.FixtureRequest) -> Rig:
    return open_rig(request)


PROMPT = "Think, then reply in JSON."


def _marker(rig: Rig, tokens: list[int]) -> tuple[str, int]:
    """An end marker the greedy output writes early, cut across two of its tokens, and
    the index of the token that completes it (the prefix decode first holds it there)."""
    for i in range(1, min(12, len(tokens) - 2)):
        marker = rig.tok.decode(tokens[i : i + 2])
        if not marker.strip() or len(marker) < 2:
            continue
        ends = [j for j in range(len(tokens)) if marker in rig.tok.decode(tokens[: j + 1])]
        if ends and ends[0] == i + 1 and marker not in rig.tok.decode(tokens[: i + 1]):
            return marker, i + 1
    pytest.skip(f"no early marker in {rig.tok.decode(tokens)!r}")


def _unmasked(rig: Rig, step: Any) -> bool:
    """A step nothing was masked at: every engine reports no allowed mass there."""
    return step.allowed_mass is None


def _gated(rig: Rig, marker: str, schema: Any = SCHEMAS[1]) -> Any:
    return constraint_from(json_schema=schema).bind(rig.tok).after_reasoning((marker,))


def test_reasoning_is_unmasked_then_the_content_validates(rig: Rig) -> None:
    ids = chat_ids(rig.tok, PROMPT)
    free = [s.token for s in rig.run(ids, None, limit=16)]
    marker, end = _marker(rig, free)
    steps = rig.run(ids, _gated(rig, marker), limit=end + 1 + LIMIT, top_logprobs=2)
    got = [s.token for s in steps]
    assert got[: end + 1] == free[: end + 1]  # unmasked: the engine's own greedy tokens
    assert all(_unmasked(rig, s) for s in steps[: end + 1])
    assert all(0 < s.allowed_mass <= 1 + 1e-6 for s in steps[end + 1 :])
    assert all(s.distribution == "raw" for s in steps)
    text = rig.text(steps)
    content = text[text.index(marker) + len(marker) :]
    jsonschema.validate(json.loads(content), SCHEMAS[1])
    # the raw logprobs of the reasoning steps are the model's own
    want = rig.oracle(ids + got, len(ids))
    for n, s in enumerate(steps[: end + 1]):
        assert s.logprob == pytest.approx(float(want[n][s.token]), abs=2e-3)


def test_reasoning_that_never_ends_is_never_masked(rig: Rig) -> None:
    ids = chat_ids(rig.tok, PROMPT)
    free = [s.token for s in rig.run(ids, None, limit=10)]
    marker = "\u2603 never written \u2603"
    assert marker not in rig.tok.decode(free)
    steps = rig.run(ids, _gated(rig, marker), limit=10)
    assert [s.token for s in steps] == free
    assert all(_unmasked(rig, s) for s in steps)


def test_batch_rows_start_their_mask_after_their_own_reasoning(rig: Rig) -> None:
    from tokentrail.engines.batch import open_batch
    from tokentrail.sampling import make_params

    ids = chat_ids(rig.tok, PROMPT)
    free = [s.token for s in rig.run(ids, None, limit=16)]
    marker, end = _marker(rig, free)
    c = _gated(rig, marker)
    solo = rig.run(ids, c, limit=end + 1 + LIMIT)
    try:
        batch = open_batch(rig.engine, 2)
    except (TypeError, NotImplementedError, AttributeError) as e:
        pytest.skip(f"{type(rig.engine).__name__} has no batch: {e}")
    uid = batch.add(ids, make_params(constraint=c), end + 1 + LIMIT)
    other = batch.add(
        chat_ids(rig.tok, "Other."), make_params(constraint=c.after_reasoning()), LIMIT
    )
    got = drain(batch, rig.eos)
    batch.close()
    assert [s.token for s in got[uid]] == [s.token for s in solo]
    assert [_unmasked(rig, s) for s in got[uid]] == [_unmasked(rig, s) for s in solo]
    # the other row's constraint starts at once: every step masked, the output valid
    assert all(s.allowed_mass is not None for s in got[other])
    jsonschema.validate(json.loads(rig.text(got[other])), SCHEMAS[1])
