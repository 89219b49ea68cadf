"""Branch from any token: a reply's first `at` tokens kept, a token forced at `at` (or
sampled afresh there), and fresh generation after it (`stream_generate(branch=...)`, the
server's ``branch`` request option).

A branch is the same prompt continued from a point inside an earlier reply. The engine
reads prompt + kept prefix (+ the forced token) as its prompt, so on the server the
prefix comes from its prompt cache; the kept prefix is re-emitted through the sequence's
one output stage (`output.processor.OutputProcessor`) from the original reply's own
engine records, so its segments, fields, channels, tokens, logprobs and alternatives are
the original's.

- `BranchSpec`: what is asked (`ids`, `at`, `token`), read from a mapping.
- `ReplyMemory`: a small LRU of finished replies' per-token engine records (token,
  logprob, top alternatives, provenance), keyed by the prompt's ids and the settings that
  shape a logprob (`signature`). The scheduler records every sequence's steps and keeps
  them here when it ends.
- `check_branch`: the checks on the ids (a `BranchError` naming the position, whose
  `param` is ``branch.ids`` / ``branch.at`` / ``branch.token``; a 400 over HTTP). "Ids
  the tokenizer can produce after this prompt" means: each id is inside the model's and
  the tokenizer's vocabulary, has bytes (or a name) in the tokenizer, is not the
  tokenizer's BOS (a prompt-only control token, unless it is also an EOS id), and an EOS
  id only ends the ids (nothing follows an end of sequence). Other special tokens stay
  allowed: replies carry them (reasoning and tool-call markers).
- `plan_branch`: what the engine reads (`Branch.engine_ids`) and the steps replayed
  before its first one (`Branch.replay`), from the memory, else from one forward pass of
  the model over prompt + prefix (+ token) with logits at every position
  (`engines.scoring.position_logprobs`: MLX, torch and llama.cpp), else a `BranchError` saying
  why. The library has no memory of earlier replies: it always takes the forward pass.

The forced token's own record is the original's distribution at `at` when the token is
among the alternatives recorded there (its logprob and the same alternatives), else that
forward pass.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .engines.base import Step
from .engines.scoring import position_logprobs
from .errors import BranchError
from .sampling import SamplingParams
from .vocab import Vocab

logger = logging.getLogger("tokentrail")

__all__ = [
    "REPLY_MEMORY_TOKENS",
    "Branch",
    "BranchSpec",
    "Record",
    "ReplyMemory",
    "check_branch",
    "plan_branch",
    "record_of",
    "signature",
]


@dataclass(frozen=True)
class BranchSpec:
    """Continue the reply `ids` from position `at`: its first `at` ids kept, `token`
    forced at `at` (None: sampled afresh there)."""

    ids: tuple[int, ...]
    at: int
    token: int | None = None

    @classmethod
    def of(cls, value: Any) -> BranchSpec:
        """A spec from a mapping ``{"ids": [...], "at": N, "token": ID}`` (or an object
        with those attributes); TypeError / BranchError naming the key otherwise."""
        if isinstance(value, BranchSpec):
            return value
        get = value.get if isinstance(value, Mapping) else lambda k, d=None: getattr(value, k, d)
        if isinstance(value, Mapping) and set(value) - {"ids", "at", "token"}:
            extra = sorted(set(value) - {"ids", "at", "token"})
            raise BranchError(f"branch has unknown keys {extra}", "branch")
        ids, at, token = get("ids"), get("at"), get("token", None)
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise TypeError(f"branch.ids must be a list of token ids, got {type(ids).__name__}")
        for name, v in (("at", at), ("token", token), *(("ids", i) for i in ids)):
            if v is None and name == "token":
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"branch.{name} must be an int, got {v!r}")
            if v < 0:
                raise BranchError(f"branch.{name} must be >= 0, got {v}", f"branch.{name}")
        return cls(tuple(ids), at, token)


#: How many recorded reply tokens the memory keeps at most, over all replies.
REPLY_MEMORY_TOKENS = 1 << 16

#: One generated token as the engine reported it, without the engine's full vector:
#: (token, logprob, top alternatives, from_draft, distribution, allowed_mass).
Record = tuple[int, float, Sequence[tuple[int, float]], bool, str, "float | None"]


def record_of(step: Step) -> Record:
    """The parts of `step` a replay needs (never the engine's full logprob vector).

    Tuples of plain numbers and strings only: Python's collector stops tracking such
    tuples after one pass, so the memory's tens of thousands of records cost nothing in
    the full collections of a long-running server (a list here kept every record
    tracked: about a third of the proxy's CPU per token went to traversing them)."""
    top = step.top_logprobs
    return (
        step.token, step.logprob, tuple(map(tuple, top)) if top else (), step.from_draft,
        step.distribution, step.allowed_mass,
    )  # fmt: skip


def _step(record: Record, k: int) -> Step:
    token, logprob, top, drafted, distribution, mass = record
    return Step(token, logprob, list(top[:k]), None, drafted, distribution, mass)


def signature(params: SamplingParams) -> tuple[Any, ...]:
    """The settings a step's logprob and alternatives depend on, besides the ids: the
    repetition penalty and logit bias (applied before the raw distribution), and for the
    "processed" distribution the temperature and filters too."""
    bias = tuple(sorted((params.logit_bias or {}).items()))
    shaped: tuple[Any, ...] = ()
    if params.logprobs_mode == "processed":
        shaped = (params.temp, params.top_p, params.top_k, params.min_p)
    return (params.logprobs_mode, params.repetition_penalty, params.presence_penalty,
            params.frequency_penalty, bias, shaped)  # fmt: skip


@dataclass(eq=False)
class _Reply:
    prompt: tuple[int, ...]
    sig: tuple[Any, ...]
    k: int
    records: list[Record]


class ReplyMemory:
    """Finished replies' engine records, least recently used first, at most `limit`
    tokens in all. Only the model thread touches it."""

    def __init__(self, limit: int = REPLY_MEMORY_TOKENS) -> None:
        self.limit = limit
        self._replies: OrderedDict[int, _Reply] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._replies)

    def keep(
        self, prompt: Sequence[int], params: SamplingParams, records: list[Record]
    ) -> None:
        """Keep a reply's records (`params`: the settings it was generated with)."""
        if not records or len(records) > self.limit:
            return
        reply = _Reply(tuple(prompt), signature(params), params.top_logprobs, records)
        self._replies[id(reply)] = reply
        self.tokens += len(records)
        while self.tokens > self.limit:
            _, old = self._replies.popitem(last=False)
            self.tokens -= len(old.records)

    def find(
        self, prompt: Sequence[int], params: SamplingParams, prefix: Sequence[int], need: int
    ) -> list[Record] | None:
        """Records of a kept reply for this prompt and settings whose first tokens are
        `prefix` and which has at least `need` records (a record at `len(prefix)` holds
        the distribution there, whichever token was drawn), with at least as many
        alternatives per step as `params` asks; None when none is kept."""
        key, sig, n = tuple(prompt), signature(params), len(prefix)
        for uid, reply in reversed(self._replies.items()):
            recs = reply.records
            if reply.prompt != key or reply.sig != sig or reply.k < params.top_logprobs:
                continue
            if len(recs) < need or any(recs[i][0] != prefix[i] for i in range(n)):
                continue
            self._replies.move_to_end(uid)
            return recs
        return None


@dataclass(frozen=True)
class Branch:
    """A checked branch: the engine's prompt (`engine_ids`: prompt + kept prefix, + the
    forced token), the steps the output stage reads before the engine's first one
    (`replay`), and where they came from (`source`: "memory" or "forward pass")."""

    engine_ids: list[int]
    replay: list[Step]
    source: str


def _bad(param: str, message: str) -> BranchError:
    return BranchError(message, f"branch.{param}")


def check_branch(
    branch: BranchSpec,
    vocab: Vocab,
    model_vocab_size: int | None,
    eos: frozenset[int],
    bos: int | None,
) -> None:
    """Refuse ids the tokenizer cannot produce after the prompt (see the module), an `at`
    past the ids, and a forced token that is not a token the reply could hold: a
    `BranchError` naming the position and the key."""
    ids, at = branch.ids, branch.at
    if at > len(ids):
        raise _bad("at", f"'branch.at' is {at}, past the {len(ids)} ids given")
    size = vocab.size if model_vocab_size is None else min(vocab.size, model_vocab_size)
    for i, token in enumerate(ids):
        why = _unproducible(token, vocab, size, bos, eos)
        if why is None and token in eos and i < len(ids) - 1:
            why = "an end-of-sequence id, which only the reply's last token can be"
        if why is not None:
            raise _bad("ids", f"'branch.ids' position {i}: token id {token} is {why}")
    if at and ids[at - 1] in eos:
        raise _bad(
            "at",
            f"'branch.at' is {at}: the kept prefix ends with the end-of-sequence "
            f"id at position {at - 1}, after which nothing can be generated",
        )
    if branch.token is not None:
        why = _unproducible(branch.token, vocab, size, bos, eos)
        if why is not None:
            raise _bad(
                "token",
                f"'branch.token' (forced at position {at}): "
                f"token id {branch.token} is {why}",
            )


def _unproducible(
    token: int, vocab: Vocab, size: int, bos: int | None, eos: frozenset[int]
) -> str | None:
    """Why a reply cannot hold `token` (None: it can)."""
    if token >= size:
        return f"outside the vocabulary (valid ids are 0..{size - 1})"
    if vocab.pieces[token] is None and token not in vocab.names:
        return "not a token of the tokenizer (it has no text)"
    if token == bos and token not in eos:  # some tokenizers use one id for both
        return "the tokenizer's beginning-of-sequence token, which only a prompt holds"
    return None


def plan_branch(
    branch: BranchSpec,
    prompt: list[int],
    params: SamplingParams,
    engine: Any,
    memory: ReplyMemory,
) -> Branch:
    """The engine's prompt and the replayed steps for a checked `branch` (see the
    module); `BranchError` when the prefix's records are not in memory and the engine
    cannot compute them."""
    kept = list(branch.ids[: branch.at])
    forced = branch.token
    need = len(kept) + (forced is not None)
    k = params.top_logprobs
    found = memory.find(prompt, params, kept, need)
    engine_ids = prompt + kept + ([] if forced is None else [forced])
    if found is not None:
        replay = [_step(r, k) for r in found[: len(kept)]]
        if forced is None:
            return Branch(engine_ids, replay, "memory")
        at = found[len(kept)]
        top = dict(at[2])
        if forced in top:
            forced_step = Step(forced, top[forced], list(at[2][:k]), None, False, at[4], at[5])
            return Branch(engine_ids, [*replay, forced_step], "memory")
    param = "ids" if found is None else "token"
    if found is None:
        missing = (
            "the original reply's records are not in memory (on the server: it was "
            "generated with other settings or fewer top_logprobs, or was evicted)"
        )
    else:
        missing = (
            f"the forced token {forced} is not among the alternatives recorded at position "
            f"{len(kept)} (ask the original with more top_logprobs)"
        )
    steps = _forward(engine, prompt, kept, forced, params, (param, missing))
    if found is not None:  # only the forced token's record was missing
        return Branch(engine_ids, [*replay, steps[-1]], "memory and forward pass")
    return Branch(engine_ids, steps, "forward pass")


def _forward(
    engine: Any,
    prompt: list[int],
    kept: list[int],
    forced: int | None,
    params: SamplingParams,
    missing: tuple[str, str],
) -> list[Step]:
    """The prefix's (and forced token's) steps from one forward pass; `BranchError`
    (`missing`: its param and what was not found) where the engine has no logits in
    process or the settings change the distribution."""
    tail = kept + ([] if forced is None else [forced])
    if not tail:
        return []
    why = None
    if params.logprobs_mode == "processed":
        why = "the 'processed' logprobs depend on the original reply's sampling"
    elif (params.repetition_penalty or params.logit_bias or params.presence_penalty
          or params.frequency_penalty):  # fmt: skip
        why = "a penalty or logit bias changes the model's own distribution"
    rows = None
    if why is None:
        rows, why = position_logprobs(engine, prompt + tail, len(prompt), params.top_logprobs)
    if rows is None:
        raise _bad(
            missing[0],
            f"{missing[1]}, and the logprobs cannot be computed again here: {why}; send the "
            "original request again, then branch",
        )
    logger.debug("branch: %d prefix records computed by a forward pass", len(rows))
    return [Step(tok, lp, top, None) for tok, (lp, top) in zip(tail, rows, strict=True)]
