"""Constrained decoding and processed logprobs on llama.cpp: `GuidedChain`.

Two custom samplers in llama.cpp's own chain (llama-cpp-python's `add_custom`), placed
as llama.cpp places its grammar sampler: `mask` after logit bias and the repeat penalty,
before top-k/top-p/min-p/temperature, sets every id the `Guide` does not allow to -inf
in the candidate array and notes the mass the (biased, penalised) distribution put on
the allowed ids; `record`, the last before the draw (`dist` or `greedy`), copies the
candidates as the chain leaves them, i.e. the distribution the token is drawn from
(the "processed" logprobs). The logits buffer itself is untouched, so the raw logprobs
are read from it as without a constraint.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

from ...sampling import SamplingParams
from ..base import Step

__all__ = ["GuidedChain", "guided_chain", "guided_step"]

_FLOATS_PER_ENTRY = 3  # llama_token_data: int32 id, float logit, float p


def _candidates(cur_p: Any) -> np.ndarray:
    """A (size, 3) float32 view over a `llama_token_data_array` (column 0 holds the ids'
    int32 bits, column 1 the logits)."""
    arr = cur_p.contents
    ptr = ctypes.cast(arr.data, ctypes.POINTER(ctypes.c_float))
    return np.ctypeslib.as_array(ptr, shape=(int(arr.size), _FLOATS_PER_ENTRY))


def _logsumexp(x: np.ndarray) -> float:
    m = float(x.max())
    if m == -math.inf:
        return m
    return m + math.log(float(np.exp(x - np.float32(m)).sum(dtype=np.float64)))


class GuidedChain:
    """The state the custom samplers of one sequence share: its guide (None: no
    constraint), this step's allowed ids, the log of the allowed mass, and (when
    `record`) the drawn-from candidates."""

    __slots__ = ("allowed", "guide", "log_mass", "n_vocab", "recorded", "wants_record")

    def __init__(self, guide: Any, n_vocab: int, record: bool) -> None:
        self.guide = guide
        self.n_vocab = n_vocab
        self.wants_record = record
        self.allowed: np.ndarray | None = None
        self.log_mass = 0.0
        self.recorded: tuple[np.ndarray, np.ndarray] | None = None

    def prepare(self) -> None:
        """Compute this step's mask (before the chain samples); none while the guide is
        not active (the model reasons before a constraint that starts after it)."""
        if self.guide is not None:
            self.allowed = self.guide.allowed(self.n_vocab) if self.guide.active else None

    def mask(self, cur_p: Any) -> None:
        """Custom sampler: disallowed ids to -inf; note the allowed mass."""
        if self.allowed is None:
            return
        cand = _candidates(cur_p)
        ids = cand[:, 0].view(np.int32)
        logits = cand[:, 1]
        keep = self.allowed[ids]
        total = _logsumexp(logits)
        self.log_mass = _logsumexp(logits[keep]) - total
        logits[~keep] = -np.inf

    def record(self, cur_p: Any) -> None:
        """Custom sampler: copy the candidates the draw will use."""
        cand = _candidates(cur_p)
        self.recorded = (cand[:, 0].view(np.int32).copy(), cand[:, 1].astype(np.float64))

    def processed(self, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
        """The sampled token's logprob and the top-k under the drawn-from distribution."""
        if self.recorded is None:
            raise RuntimeError("llama.cpp's chain did not run the recording sampler")
        ids, logits = self.recorded
        lse = _logsumexp(logits)
        hit = np.nonzero(ids == token)[0]
        lp = float(logits[hit[0]]) - lse if hit.size else -math.inf
        top: list[tuple[int, float]] = []
        if k:
            n = min(k, ids.size)
            pick = np.argpartition(-logits, n - 1)[:n] if ids.size > n else np.arange(ids.size)
            order = sorted(pick.tolist(), key=lambda i: (-logits[i], int(ids[i])))
            top = [(int(ids[i]), float(logits[i]) - lse) for i in order if logits[i] > -np.inf]
        return lp, top

    def allowed_mass(self) -> float | None:
        """The raw mass the model put on this step's allowed ids (None: no constraint,
        or none masked this step)."""
        return math.exp(self.log_mass) if self.allowed is not None else None

    def finish(self, token: int) -> None:
        """Move the guide past the sampled token."""
        if self.guide is not None:
            self.guide.advance(token)


def guided_chain(params: SamplingParams, n_vocab: int) -> GuidedChain | None:
    """The custom samplers' state for one sequence when `params` needs them (a bound
    constraint, or processed logprobs), else None."""
    if params.constraint is None and params.logprobs_mode == "raw":
        return None
    guide = None if params.constraint is None else params.constraint.guide()
    return GuidedChain(guide, n_vocab, params.logprobs_mode == "processed")


def guided_step(
    guided: GuidedChain | None,
    token: int,
    lp: float,
    top: list[tuple[int, float]],
    full: Any,
    params: SamplingParams,
) -> Step:
    """The Step of a sampled token (raw `lp`/`top`, as read from the logits), with the
    processed logprobs and allowed mass when `guided`; moves the guide past `token`."""
    if guided is None:
        return Step(token, lp, top, full)
    if guided.wants_record:
        lp, top = guided.processed(token, params.top_logprobs)
    mass = guided.allowed_mass()
    guided.finish(token)
    return Step(token, lp, top, full, False, params.logprobs_mode, mass)
