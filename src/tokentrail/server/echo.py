"""``echo`` on ``/v1/completions``: the prompt returned before the completion, with its
tokens' logprobs when ``logprobs`` is asked (OpenAI's legacy API; lm-evaluation-harness's
``local-completions`` scores a continuation so: ``echo``, ``logprobs`` and the prompt's
``token_logprobs`` past the context).

The text is the prompt as sent (a string), or its tokens' text (token ids). The
prompt's entries come first in ``logprobs``: each token's string as the completion's
are spelled, its logprob teacher-forced after the tokens before it (the model's own
distribution, no sampling processors: `engines.scoring.position_logprobs`, one forward
pass over the prompt) and its ``logprobs`` most likely alternatives; the first token has
none (null), as in OpenAI's and vLLM's answers. ``text_offset`` counts the characters
the prompt's bytes complete before each token. The completion's own entries follow,
their offsets after the echoed text. Streamed, the first chunk carries the prompt.

The prompt's logprobs need the model's logits at every position: MLX, torch and
llama.cpp compute them in process (`engines.llamacpp.positions`), vLLM as its own
``prompt_logprobs`` (`engines.vllm.positions`). Through the proxy they are asked of a
vLLM upstream (`engines.upstream.positions`), in a thread before the request joins the
batch (`fetch_prompt_rows`: the scheduler's passes run on the event loop there); other
upstreams have none, and ``echo`` with ``logprobs`` is a 400 naming ``echo``. ``echo``
alone works everywhere. The
``tokentrail`` extension's segments stay the completion's.

``echo`` with ``max_tokens`` 0 (`GenRequest.prompt_only`) is the prompt alone: the
scheduler runs no step and ends each choice with "length"
(`Formatter.prompt_chunk`).
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any

from ..engines.scoring import Row, position_logprobs
from ..errors import APIError
from .protocol import GenRequest
from .wire_tokens import Spellings

__all__ = ["Echo", "echo_for", "fetch_prompt_rows", "prompt_logprobs", "wants_fetch"]


@dataclass(frozen=True, slots=True)
class Echo:
    """The prompt as a completion echoes it: its `text`, token `ids` and, with logprobs,
    one `Row` per token after the first (None: no logprobs asked)."""

    text: str
    ids: tuple[int, ...]
    rows: tuple[Row, ...] | None


def echo_for(req: GenRequest, ids: list[int], engine: Any, tokenizer: Any) -> Echo | None:
    """The request's `Echo` (None without ``echo``), or APIError 400 naming ``echo`` where
    the prompt's logprobs are asked and the engine has no logits in process."""
    if not req.echo:
        return None
    rows = None
    if req.logprobs:
        fetched = req.fetched_rows
        if fetched is not None and fetched[0] == tuple(ids):
            found, why = fetched[1], fetched[2]
        else:
            found, why = position_logprobs(engine, list(ids), 1, req.top_logprobs)
        if found is None:
            raise APIError(
                400,
                f"'echo' with 'logprobs' needs the prompt's logprobs, and {why} (MLX, "
                "torch, llama.cpp and vLLM do); leave 'logprobs' out to echo the prompt's text",
                param="echo",
                code="unsupported_value",
            )
        rows = tuple(found)
    text = req.prompt if isinstance(req.prompt, str) else tokenizer.decode(list(ids))
    return Echo(text, tuple(ids), rows)


def wants_fetch(req: GenRequest, engine: Any) -> bool:
    """Whether the prompt's logprobs are asked of an upstream before `req` joins the
    batch (`fetch_prompt_rows`): ``echo`` with ``logprobs`` through the proxy."""
    return req.echo and req.logprobs and getattr(engine, "name", None) == "upstream"


def fetch_prompt_rows(req: GenRequest, engine: Any, tokenizer: Any) -> None:
    """Ask the upstream for the prompt's logprobs and keep them on `req` (its
    `fetched_rows`: the ids, the rows or None, why not), for `echo_for`. Blocking: run
    it in a thread. A prompt that does not encode is left to `prepare`'s 400."""
    from ..engines.upstream.positions import position_rows
    from ..prompting import prompt_ids

    try:
        ids = prompt_ids(tokenizer, req.prompt, engine.vocab_size,
                         add_special_tokens=req.add_special_tokens)  # fmt: skip
    except (ValueError, TypeError):
        return
    rows, why = position_rows(engine, ids, 1, req.top_logprobs)
    req.fetched_rows = (tuple(ids), rows, why)


def prompt_logprobs(echo: Echo, spell: Spellings, top: int) -> dict[str, list[Any]]:
    """The prompt's entries of a completion's ``logprobs`` (see the module)."""
    assert echo.rows is not None
    name = spell.completion_token
    tokens, lps, tops, offsets = [], [], [], []
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    at = 0
    for i, tid in enumerate(echo.ids):
        tokens.append("" if tid in spell.skip else name(tid))
        offsets.append(at)
        if i == 0:
            lps.append(None)
            tops.append(None)
        else:
            lp, alts = echo.rows[i - 1]
            lps.append(lp)
            listed: dict[str, float] = {}
            for aid, alp in alts[:top]:
                listed.setdefault("" if aid in spell.skip else name(aid), alp)
            tops.append(listed)
        if tid not in spell.skip:
            at += len(decoder.decode(bytes(spell.token_bytes(tid))))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
