"""The torch engine's sampling: mlx-lm's logits processors and samplers in torch, the
filters of the processed distribution, and the constrained-decoding mask.

The same settings mean the same thing as on the MLX engine (`engines.mlx.sampling`):
logit bias then the repetition, presence and frequency penalties (`make_processors`),
top-p, min-p and top-k then temperature (`make_sampler`, `processed_logprobs`), each
filter checked against mlx-lm's own in `tests/test_torch_engine.py`.
`tokentrail.engines.torch_engine` runs them on each step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..sampling import SamplingParams

__all__ = [
    "apply_min_p",
    "apply_top_k",
    "apply_top_p",
    "filtered",
    "guide_mask",
    "make_processors",
    "make_sampler",
    "processed_logprobs",
]


# -- constrained decoding and processed logprobs --------------------------------------


def guide_mask(
    guide: Any, logprobs: torch.Tensor, previous: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logprobs` masked to what `guide` allows (renormalised) and the log of the raw
    mass on the allowed ids (None, and `logprobs` as they are, while the guide's gate
    keeps the mask off). `previous` is the token just sampled (None at the first
    step): the guide moves past it first. The model's forward pass is already queued,
    so on CUDA llguidance works while the device computes."""
    if previous is not None:
        guide.advance(int(previous.item()))
    if not guide.active:  # the model still reasons: no mask yet, and no mass to report
        return logprobs, None
    allowed = torch.from_numpy(guide.allowed(logprobs.shape[-1])).to(logprobs.device)
    kept = logprobs.masked_fill(~allowed, -math.inf)
    log_mass = torch.logsumexp(kept, dim=-1)
    return kept - log_mass, log_mass


def processed_logprobs(logprobs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from: the top-p, min-p and top-k filters, then
    temperature, normalised (at temperature 0: `logprobs` itself)."""
    if params.temp == 0:
        return logprobs
    return torch.log_softmax(filtered(logprobs, params) * (1.0 / params.temp), dim=-1)


def filtered(logprobs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`logprobs` with the top-p, min-p and top-k filters applied, in mlx-lm's order
    (what each drops at minus infinity); the sampler and `processed_logprobs` share it."""
    x = logprobs
    if 0 < params.top_p < 1:
        x = apply_top_p(x, params.top_p)
    if params.min_p > 0:
        x = apply_min_p(x, params.min_p)
    if 0 < params.top_k < x.shape[-1]:
        x = apply_top_k(x, params.top_k)
    return x


# -- mlx-lm's logits processors and samplers, in torch --------------------------------


def make_processors(
    params: SamplingParams, device: torch.device
) -> Callable[[Any, torch.Tensor], torch.Tensor] | None:
    """Logit bias, then the repetition, presence and frequency penalties over the same
    recent tokens (mlx-lm's `make_logits_processors`, in its order)."""
    bias_ids = bias_values = None
    if params.logit_bias:
        bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        bias_values = torch.tensor(
            list(params.logit_bias.values()), dtype=torch.float32, device=device
        )
    penalty = params.repetition_penalty
    if penalty == 0:
        penalty = None
    presence, frequency = params.presence_penalty, params.frequency_penalty
    if bias_ids is None and penalty is None and not presence and not frequency:
        return None

    def process(history: Any, logits: torch.Tensor) -> torch.Tensor:
        if bias_ids is not None:
            logits = logits.index_add(0, bias_ids, bias_values)
        if penalty is not None and history is not None and history.numel():
            selected = logits[history]
            # Sign-aware: a penalty > 1 always makes a seen token less likely.
            logits[history] = torch.where(selected < 0, selected * penalty, selected / penalty)
        if history is not None and history.numel():
            if presence:  # once per token seen, however often
                logits[history] -= presence
            if frequency:  # once per time it was seen
                logits = logits.index_add(0, history, logits.new_full(history.shape, -frequency))
        return logits

    return process


def make_sampler(
    params: SamplingParams, generator: torch.Generator | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Pick a token from logprobs (1-D); returns a 1-element long tensor on the device."""
    if params.temp == 0:
        return lambda logprobs: torch.argmax(logprobs, dim=-1, keepdim=True)
    inv_temp = 1.0 / params.temp

    def sampler(logprobs: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(filtered(logprobs, params) * inv_temp, dim=-1)
        # argmax(p / E) with E ~ Exp(1) draws from p without a host sync (unlike
        # torch.multinomial on CUDA); the clamp keeps a zero draw from dividing by zero.
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return torch.argmax(probs / noise.clamp_min(torch.finfo(probs.dtype).tiny), keepdim=True)

    return sampler


def apply_top_p(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the tokens whose more likely tokens hold less than `top_p` of the mass."""
    ordered = torch.sort(logprobs).values  # ascending
    probs = ordered.exp()
    rev = torch.cumsum(probs.flip(0), dim=0)
    # mass_above[i]: the total probability of the tokens after position i (more likely).
    mass_above = torch.cat([rev.new_zeros(1), rev[:-1]]).flip(0)
    total = mass_above[:1] + probs[:1]
    dropped = (mass_above >= top_p * total).sum(dim=-1, keepdim=True)
    threshold = ordered.gather(0, dropped)
    return logprobs.masked_fill(logprobs < threshold, -math.inf)


def apply_min_p(logprobs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep the tokens at least `min_p` times as likely as the most likely one."""
    return logprobs.masked_fill(logprobs < logprobs.max() + math.log(min_p), -math.inf)


def apply_top_k(logprobs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep exactly the `top_k` most likely tokens."""
    top = torch.topk(logprobs, top_k)
    return torch.full_like(logprobs, -math.inf).scatter(0, top.indices, top.values)
