"""``token_id:N`` token strings (vLLM's ``return_tokens_as_token_ids``).

With ``--return-tokens-as-token-ids`` (server flag) or ``"return_tokens_as_token_ids":
true`` (request), vLLM writes every token string in the logprobs, alternatives
included, as ``token_id:N``: exact ids, for the main token and for each alternative.
"""

from __future__ import annotations

from ...vocab import Vocab

NAME = "token-id-strings"
PREFIX = "token_id:"


def claims(token: str | None) -> bool:
    """Whether a logprobs token string is in this form."""
    return token is not None and token.startswith(PREFIX)


def identify(token: str, vocab: Vocab) -> tuple[int | None, str | None]:
    """(id, None) for a ``token_id:N`` string naming a token of `vocab`, else (None, why)."""
    try:
        tid = int(token[len(PREFIX) :])
    except ValueError:
        return None, f"{token!r} is not a token id"
    if not vocab.has_id(tid):
        return None, f"id {tid} is outside the vocabulary of {vocab.name}"
    return tid, None
