"""Checks on what `stream_generate` yields (shared by the MLX test modules)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokentrail import Aligner, GenerationResponse
from tokentrail.prompting import vocab_for


def check_exact(tok: Any, prompt_ids: Sequence[int], out: list[GenerationResponse]) -> None:
    """prompt_text + the texts == decode(prompt + ids); every token attributed once, all
    of its bytes, in order; EOS reported with no bytes."""
    eos = set(tok.eos_token_ids)
    ids = [r.token for r in out]
    body = ids[:-1] if ids and ids[-1] in eos and out[-1].finish_reason == "stop" else ids
    text = "".join(r.text for r in out)
    full = tok.decode(list(prompt_ids) + body, skip_special_tokens=True)
    prompt_text = Aligner(vocab_for(tok), skip_special_tokens=True, prompt_ids=prompt_ids)
    assert prompt_text.prompt_text + text == full
    vocab = vocab_for(tok)
    spans = [t for r in out for t in r.last_segment_tokens if t.index >= 0]
    covered: dict[int, int] = {}
    for t in spans:
        assert t.id == ids[t.index]
        assert t.start == covered.get(t.index, 0), "each byte of a token is used once"
        covered[t.index] = t.end
    assert sorted(covered) == list(range(len(ids)))
    for i, end in covered.items():
        want = 0 if (i == len(body) and ids[i] in eos) else len(vocab.token_bytes(ids[i]))
        assert end == want
    assert [t.index for t in spans] == sorted(t.index for t in spans)


def assert_batch_equals_solo(
    engine: Any,
    batch: Any,
    jobs: list[tuple[Any, ...]],
    *,
    late: int,
    tol: float,
    after_late: Any = None,
) -> None:
    """Run `jobs` ((prompt_ids, params, max_tokens) each) through `batch`: the first
    added at once, the rest after 2 steps (`late`: how many of them join then; the
    callable `after_late` runs just after they do). Each sequence's tokens and top ids
    equal its solo run on `engine`, its logprobs within `tol`."""
    import pytest

    solo = [[(s.token, s.logprob, s.top_logprobs) for s in engine.generate(*j)] for j in jobs]
    early = len(jobs) - late
    got: dict[int, list[Any]] = {}
    uids = [batch.add(*j) for j in jobs[:early]]
    steps = 0
    while len(batch):
        if steps == 2:
            uids += [batch.add(*j) for j in jobs[early:]]
            if after_late is not None:
                after_late()
        for uid, s in batch.step():
            got.setdefault(uid, []).append((s.token, s.logprob, s.top_logprobs))
        steps += 1
    for uid, want in zip(uids, solo, strict=True):
        assert [t for t, _, _ in got[uid]] == [t for t, _, _ in want]
        for (_, lp, top), (_, lp2, top2) in zip(got[uid], want, strict=True):
            assert lp == pytest.approx(lp2, abs=tol)
            assert [i for i, _ in top] == [i for i, _ in top2]
