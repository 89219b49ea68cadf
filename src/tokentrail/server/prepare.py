"""Request preparation: a validated request made ready to join the batch, once.

`prepare` decides everything a request's sequences need before their first step, in
one place: the prompt's ids (the chat template with the tools), the token limit (the
server's context rule), the stop strings (checked), the constraint bound to the
model's tokenizer (after the reasoning where a format is on), the sampling settings
(built once, with the bound constraint) and each choice's output stage (reasoning
format, tool-call parser, fields and their scorer: `output.processor.OutputProcessor`
keywords). Anything wrong is an `APIError` 400 naming the field, before the request
takes a place in the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..branching import Branch, BranchSpec, ReplyMemory, check_branch, plan_branch
from ..engines.base import rewinder
from ..errors import ActionError, APIError, BranchError, ConstraintError, ContextOverflow
from ..output.alarm import checked_alarm
from ..prompting import eos_ids, prompt_ids, room, stop_matcher, vocab_for
from ..sampling import SamplingError, SamplingParams, check_max_tokens
from ..structure.tool_choice import tool_parser_for
from .config import ServerConfig
from .echo import echo_for
from .protocol import GenRequest
from .structured import bound, structure_options

logger = logging.getLogger("tokentrail.server")

__all__ = ["Prepared", "prepare"]


@dataclass(frozen=True, slots=True)
class Prepared:
    """What a request's `n` sequences start from: prompt `ids`, the token `limit`, the
    sampling `params` (choice j derives its seed from them) and, per choice, its
    `OutputProcessor` keywords (`outputs`); `branch`: where the request's ``branch``
    option continues (the engine's prompt and the replayed prefix), None without one."""

    ids: list[int]
    limit: int
    params: SamplingParams
    outputs: tuple[dict[str, Any], ...]
    branch: Branch | None = None
    #: ``tokentrail.retry``: the choices run outside the batch on the engine's
    #: rewindable steps (`server.solo`); None: in the batch.
    retry: Any = None


def prepare(
    req: GenRequest,
    engine: Any,
    tokenizer: Any,
    config: ServerConfig,
    replies: ReplyMemory | None = None,
    *,
    context_length: int | None = None,
) -> Prepared:
    """`req` made ready for `engine` (see the module); APIError 400 naming the field.
    `replies`: earlier replies' records, where a branch's prefix is replayed from;
    `context_length`: the most tokens a request may hold (None: the engine's)."""
    try:
        ids = prompt_ids(tokenizer, req.prompt, engine.vocab_size, req.tools,
                         template=req.template, add_special_tokens=req.add_special_tokens)
        limit = _limit(req, len(ids), context_length, engine.context_length)
        stop_matcher(req.stop)
        chat = req.kind == "chat"
        constraint = bound(req.structure, tokenizer, config.reasoning, chat)
        params = req.params(engine.vocab_size, constraint)
        outputs = tuple(_output(req, ids, engine, tokenizer, config) for _ in range(req.n))
        req.echoed = echo_for(req, ids, engine, tokenizer)  # read by its `Formatter`s
        req.prompt_ids = tuple(ids) if req.return_token_ids else None
    except (SamplingError, ConstraintError) as e:
        # e.g. a logit_bias id past the engine's vocabulary; tools with no format
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    branch = None
    if req.structure.branch is not None:
        branch = _branch(req, ids, limit, params, engine, tokenizer, replies)
    retry = req.structure.retry
    if retry is not None:
        if branch is not None:
            raise APIError(
                400, "'tokentrail.branch' cannot be combined with 'tokentrail.retry' yet",
                param="tokentrail.branch", code="invalid_value",
            )
        _check_retry(req, engine)
    return Prepared(ids, limit, params, outputs, branch, retry)


def _branch(
    req: GenRequest,
    ids: list[int],
    limit: int,
    params: SamplingParams,
    engine: Any,
    tokenizer: Any,
    replies: ReplyMemory | None,
) -> Branch:
    """The request's branch checked and planned (`tokentrail.branching`), or APIError
    400 (a `BranchError`'s param inside ``tokentrail``)."""
    options = req.structure.branch
    assert options is not None
    spec = BranchSpec(tuple(options.ids), options.at, options.token)
    why = None
    if engine.name == "upstream":
        why = "is not supported through the proxy (serve --upstream): use an in-process engine"
    elif req.structure.constraint is not None:  # the grammar would restart at the prefix
        why = "is not supported together with a constraint (or a required tool call) yet"
    if why is not None:
        raise APIError(400, f"'tokentrail.branch' {why}", param="tokentrail.branch")
    try:
        check_branch(
            spec, vocab_for(tokenizer), engine.vocab_size, eos_ids(tokenizer),
            getattr(tokenizer, "bos_token_id", None),
        )  # fmt: skip
        _room(limit, spec)
        return plan_branch(spec, ids, params, engine, replies or ReplyMemory())
    except BranchError as e:
        message = str(e).replace("'branch", "'tokentrail.branch")
        raise APIError(400, message, param=f"tokentrail.{e.param}", code="invalid_value") from None


def _room(limit: int, spec: BranchSpec) -> None:
    """APIError unless `limit` (the whole reply's) leaves a token after the branch point."""
    kept = spec.at + (spec.token is not None)
    if limit <= kept:
        raise APIError(
            400,
            f"'max_tokens' ({limit}) counts the kept prefix and the forced token ({kept} "
            "tokens) and must leave room for at least one more",
            param="max_tokens",
            code="invalid_value",
        )


def _check_retry(req: GenRequest, engine: Any) -> None:
    """A 400 naming ``tokentrail.retry`` where field retry cannot run: an engine that
    cannot take tokens back, or a tool call's constraint rather than the reply's."""
    if rewinder(engine) is None:
        raise APIError(
            400,
            f"'tokentrail.retry' is not supported on the {engine.name} engine (it cannot "
            "take tokens back; see docs/acting-on-confidence.md)",
            param="tokentrail.retry",
            code="invalid_value",
        )
    if not req.structure.json_constrained:
        raise APIError(
            400, "'tokentrail.retry' retries the reply's JSON leaves, not a tool call's",
            param="tokentrail.retry", code="invalid_value",
        )


def _limit(
    req: GenRequest, n_prompt: int, context_length: int | None, whole: int | None
) -> int:
    """The token limit for a prompt of `n_prompt` tokens, or APIError (context).

    The server's rule, as OpenAI and vLLM answer: a `max_tokens` the client gave must
    fit the room the prompt leaves; the default is cut to it. `whole` is the engine's
    context; a `context_length` below it (None: the same) is a request's share of a
    split KV cache, and the error says so."""
    context_length = context_length or whole
    if req.prompt_only:  # nothing generated: the prompt needs no room after it
        return 0
    overflow = "raise" if req.max_tokens_given else "cap"
    try:
        limit = room(context_length, n_prompt, req.max_tokens, overflow=overflow)
    except ContextOverflow as e:
        prompt = "messages" if req.kind == "chat" else "prompt"
        message = str(e)
        if context_length is not None and whole is not None and context_length < whole:
            message = (
                f"{message.replace(' (max_position_embeddings)', '')}: this server splits "
                f"its KV cache of {whole} tokens among its sequences, {context_length} "
                "each (--kv-unified on shares it)"
            )
        raise APIError(
            400,
            message.replace("max_tokens is", "'max_tokens' is", 1),
            param=prompt if e.param == "prompt" else "max_tokens",
            code="context_length_exceeded",
        ) from None
    checked = check_max_tokens(limit)
    return req.max_tokens if checked is None else checked


def _output(
    req: GenRequest, ids: list[int], engine: Any, tokenizer: Any, config: ServerConfig
) -> dict[str, Any]:
    """One choice's `OutputProcessor` keywords: reasoning, tool parser, fields (with
    alternatives from the engine's scorer where it has one: one forward pass per enum
    leaf) and the alarm (`output.alarm`; on fields alone, a 400 where the reply has
    none)."""

    def scorer(output_ids: list[int]) -> Any:
        from ..engines.scoring import scorer_for

        found, why = scorer_for(engine, tokenizer, ids, output_ids, {})
        if found is None:
            logger.debug("fields without alternatives: %s", why)
        return found

    chat = req.kind == "chat"
    options = structure_options(req.structure, config.reasoning, chat, scorer, gated=True)
    alarm = req.structure.alarm
    if chat and req.structure.tool_choice is not None:
        parser = tool_parser_for(req.structure.tool_choice, config.tool_call_parser, tokenizer)
        options["tool_parser"] = parser
        if parser is not None:  # the calls' enum and boolean arguments get alternatives
            options["tools"] = req.tools
            if options.get("scorer") is None:
                options["scorer"] = scorer(options.setdefault("output_ids", []))
    if alarm is not None:
        fields = bool(options.get("fields")) or options.get("tool_parser") is not None
        try:
            options["alarm"] = checked_alarm(alarm.model_dump(), fields)
        except ActionError as e:
            param = f"tokentrail.{e.param}"
            raise APIError(400, str(e), param=param, code="invalid_value") from None
    return options
