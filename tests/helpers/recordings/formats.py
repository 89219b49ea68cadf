"""Each recording's chunks, following its project's documented wire format and its
source's emission logic (docs/realign.md cites both), with its ground truth."""

from __future__ import annotations

from typing import Any

from tests.helpers.recordings.tokens import (
    N_TOP,
    PROMPT,
    TEXT,
    Tok,
    deltas,
    incomplete_tail,
    logprob,
    openai_envelope,
    openai_token,
    valid_prefix,
)

# -- the recordings ----------------------------------------------------------------------------


def openai_chat(tok: Tok) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """OpenAI chat streaming with logprobs=true, top_logprobs=3 and include_usage.

    Tokens of one character are grouped into one chunk, whose logprobs.content lists each.
    """
    ids = tok.encode(TEXT)
    env = openai_envelope("chat.completion.chunk", "chatcmpl-rec-openai", "gpt-4o-mini")
    env["system_fingerprint"] = "fp_rec"
    first = {"index": 0, "delta": {"role": "assistant", "content": "", "refusal": None}}
    chunks = [{**env, "choices": [{**first, "logprobs": None, "finish_reason": None}]}]
    group: list[int] = []
    prev = ""
    for k in range(len(ids)):
        group.append(k)
        full = tok.decode(ids[: k + 1])
        if full.endswith("\ufffd") and k < len(ids) - 1:
            continue
        entries = []
        for j in group:
            alts = tok.plain_alternatives(ids[j], j)
            entries.append(
                {
                    "token": openai_token(tok.piece(ids[j])),
                    "logprob": logprob(j),
                    "bytes": list(tok.piece(ids[j])),
                    "top_logprobs": [
                        {
                            "token": openai_token(tok.piece(a)),
                            "logprob": logprob(j, r),
                            "bytes": list(tok.piece(a)),
                        }
                        for r, a in enumerate(alts)
                    ],
                }
            )
        choice = {
            "index": 0,
            "delta": {"content": full[len(prev) :]},
            "logprobs": {"content": entries, "refusal": None},
            "finish_reason": None,
        }
        chunks.append({**env, "choices": [choice]})
        prev = full
        group = []
    last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    chunks.append({**env, "choices": [last]})
    usage = {"prompt_tokens": 12, "completion_tokens": len(ids), "total_tokens": 12 + len(ids)}
    chunks.append({**env, "choices": [], "usage": usage})
    return chunks, {"ids": ids, "content": tok.decode(ids), "refused": []}


def openai_completions(tok: Tok) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """OpenAI legacy /v1/completions streaming with logprobs=3: one chunk per token."""
    ids = tok.encode(TEXT)
    env = openai_envelope("text_completion", "cmpl-rec-openai", "gpt-3.5-turbo-instruct")
    chunks = []
    offset = 0
    for k, (tid, text) in enumerate(zip(ids, deltas(tok, ids), strict=True)):
        alts = tok.plain_alternatives(tid, k)
        lps = {
            "tokens": [openai_token(tok.piece(tid))],
            "token_logprobs": [logprob(k)],
            "top_logprobs": [
                {openai_token(tok.piece(a)): logprob(k, r) for r, a in enumerate(alts)}
            ],
            "text_offset": [offset],
        }
        choice = {"text": text, "index": 0, "logprobs": lps, "finish_reason": None}
        chunks.append({**env, "choices": [choice]})
        offset += len(text)
    choice = {"text": "", "index": 0, "logprobs": None, "finish_reason": "stop"}
    chunks.append({**env, "choices": [choice]})
    return chunks, {"ids": ids, "content": tok.decode(ids), "refused": []}


def vllm_entry(tok: Tok, tid: int, k: int, as_ids: bool) -> dict[str, Any]:
    """vLLM's chat logprobs entry: the token decoded alone (or ``token_id:N``) and
    ``bytes`` of that string, encoded with errors='replace'."""

    def token(t: int) -> str:
        return f"token_id:{t}" if as_ids else tok.decode_one(t)

    alts = tok.plain_alternatives(tid, k)
    return {
        "token": token(tid),
        "logprob": logprob(k),
        "bytes": list(token(tid).encode("utf-8", "replace")),
        "top_logprobs": [
            {
                "token": token(a),
                "logprob": logprob(k, r),
                "bytes": list(token(a).encode("utf-8", "replace")),
            }
            for r, a in enumerate(alts)
        ],
    }


def vllm_chat(tok: Tok, *, token_ids: bool, as_ids: bool) -> tuple[list[dict], dict]:
    """vLLM chat streaming: one chunk per token, the EOS token last (finish_reason stop).

    `token_ids`: return_token_ids (prompt_token_ids on the first chunk, token_ids on
    each choice). `as_ids`: return_tokens_as_token_ids (``token_id:N`` strings).
    """
    ids = [*tok.encode(TEXT), tok.eos]
    env = openai_envelope("chat.completion.chunk", "chatcmpl-rec-vllm", "EleutherAI/pythia-1b")
    first: dict[str, Any] = {
        **env,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    if token_ids:
        first["prompt_token_ids"] = tok.encode(PROMPT)
    chunks = [first]
    for k, (tid, text) in enumerate(zip(ids, deltas(tok, ids), strict=True)):
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": text},
            "logprobs": {"content": [vllm_entry(tok, tid, k, as_ids)]},
            "finish_reason": "stop" if k == len(ids) - 1 else None,
        }
        if k == len(ids) - 1:
            choice["stop_reason"] = None
        if token_ids:
            choice["token_ids"] = [tid]
        chunks.append({**env, "choices": [choice]})
    usage = {"prompt_tokens": 7, "completion_tokens": len(ids), "total_tokens": 7 + len(ids)}
    chunks.append({**env, "choices": [], "usage": usage})
    refused = [] if token_ids or as_ids else _not_utf8_alone(tok, ids)
    return chunks, {"ids": ids, "content": tok.decode(ids), "refused": refused}


def _not_utf8_alone(tok: Tok, ids: list[int]) -> list[int]:
    out = []
    for k, tid in enumerate(ids):
        try:
            tok.piece(tid).decode("utf-8")
        except UnicodeDecodeError:
            out.append(k)
    return out


def vllm_completions(tok: Tok, *, token_ids: bool, as_ids: bool) -> tuple[list[dict], dict]:
    """vLLM /v1/completions streaming with logprobs=3; two tokens per chunk (as with a
    stream interval), the EOS token last."""
    ids = [*tok.encode(TEXT), tok.eos]
    texts = deltas(tok, ids)
    env = openai_envelope("text_completion", "cmpl-rec-vllm", "EleutherAI/pythia-1b")
    chunks = []
    offset = 0
    for start in range(0, len(ids), 2):
        part = list(range(start, min(start + 2, len(ids))))
        text = "".join(texts[k] for k in part)

        def token(t: int) -> str:
            return f"token_id:{t}" if as_ids else tok.decode_one(t)

        tokens, lps, tops, offsets = [], [], [], []
        for k in part:
            tokens.append(token(ids[k]))
            lps.append(logprob(k))
            alts = tok.plain_alternatives(ids[k], k)
            tops.append({token(a): logprob(k, r) for r, a in enumerate(alts)})
            offsets.append(offset)
            offset += len(texts[k])
        last = part[-1] == len(ids) - 1
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": {
                "text_offset": offsets,
                "token_logprobs": lps,
                "tokens": tokens,
                "top_logprobs": tops,
            },
            "finish_reason": "stop" if last else None,
            "stop_reason": None,
        }
        if token_ids:
            if start == 0:
                choice["prompt_token_ids"] = tok.encode(PROMPT)
            choice["token_ids"] = [ids[k] for k in part]
        chunks.append({**env, "choices": [choice], "usage": None})
    return chunks, {"ids": ids, "content": tok.decode(ids), "refused": []}


def llama_probability(tok: Tok, tid: int, k: int, text: bytes) -> dict[str, Any]:
    """A /completion frame's `completion_probabilities` entry for step `k`'s token `tid`,
    whose frame carries the bytes `text`."""
    alts = tok.plain_alternatives(tid, k)
    return {
        "id": tid,
        "token": valid_prefix(text).decode("utf-8", "replace"),
        "bytes": list(text),
        "logprob": logprob(k),
        "top_logprobs": [
            {
                "id": a,
                "token": valid_prefix(tok.piece(a)).decode("utf-8", "replace"),
                "bytes": list(tok.piece(a)),
                "logprob": logprob(k, r),
            }
            for r, a in enumerate(alts)
        ],
    }


def llama_completion(
    tok: Tok, *, stream: bool, return_tokens: bool, rel_model: str
) -> tuple[list[dict], dict]:
    """llama.cpp's /completion with n_probs=3, as its server's process_token emits it.

    Each token's piece is appended to the generated text; while that text ends in an
    incomplete UTF-8 character no frame is sent, and the next frame's content (and its
    probability entry's `bytes`) carries everything unsent. Special tokens render as
    nothing. `tokens` lists the frame's own token id (return_tokens).
    """
    ids = [*tok.encode(TEXT), tok.eos]
    n_prompt = len(tok.encode(PROMPT))
    generated = b""
    sent = 0
    frames = []
    probs_sent = []
    dropped = []
    for k, tid in enumerate(ids):
        piece = b"" if tid in tok.specials else tok.piece(tid)
        generated += piece
        if incomplete_tail(generated):
            dropped.append(k)
            continue
        text = generated[sent:]
        sent = len(generated)
        prob = llama_probability(tok, tid, k, text)
        probs_sent.append(prob)
        frame: dict[str, Any] = {"index": 0, "content": text.decode("utf-8")}
        if return_tokens:
            frame["tokens"] = [tid]
        frame.update(
            {
                "stop": False,
                "id_slot": 0,
                "tokens_predicted": k + 1,
                "tokens_evaluated": n_prompt,
                "completion_probabilities": [prob],
            }
        )
        frames.append(frame)
    content = generated.decode("utf-8")
    final: dict[str, Any] = {
        "index": 0,
        "content": "" if stream else content,
        "tokens": [] if stream or not return_tokens else ids,
        "id_slot": 0,
        "stop": True,
        "model": rel_model,
        "tokens_predicted": len(ids),
        "tokens_evaluated": n_prompt,
        "generation_settings": {
            "n_predict": 64,
            "seed": 42,
            "temperature": 0.8,
            "n_probs": N_TOP,
            "post_sampling_probs": False,
            "stream": stream,
        },
        "prompt": PROMPT,
        "has_new_line": False,
        "truncated": False,
        "stop_type": "eos",
        "stopping_word": "",
        "tokens_cached": n_prompt + len(ids),
        "timings": {"prompt_n": n_prompt, "predicted_n": len(ids)},
    }
    if not stream:
        final["completion_probabilities"] = probs_sent
        # A whole response with every id in `tokens` loses nothing but some logprobs.
        return [final], {"ids": ids, "content": content, "refused": []}
    return [*frames, final], {"ids": ids, "content": content, "refused": dropped}


def extension_chat(tok: Tok) -> tuple[list[dict], dict]:
    """tokentrail's server: chat chunks with the "tokentrail" extension (server.py's
    docstring), one per token, the EOS token last. Segments are computed here with the
    plain byte-level rule: text is final once its bytes end on a whole character."""
    ids = [*tok.encode(TEXT), tok.eos]
    env = openai_envelope("chat.completion.chunk", "chatcmpl-rec-tokentrail", "tiny")
    env["system_fingerprint"] = None
    chunks = []
    pending: list[tuple[int, int, int]] = []  # (index, global start, global end)
    pos = 0
    done = 0
    stream = b""
    for k, tid in enumerate(ids):
        piece = b"" if tid in tok.specials else tok.piece(tid)
        pending.append((k, pos, pos + len(piece)))
        pos += len(piece)
        stream += piece
        end = pos - incomplete_tail(stream)
        segments = []
        text = stream[done:end].decode("utf-8")
        spans = []
        keep = []
        for idx, gs, ge in pending:
            if gs < end or (gs == ge and gs <= end):
                spans.append(
                    {
                        "index": idx,
                        "id": ids[idx],
                        "start": max(done, gs) - gs,
                        "end": min(end, ge) - gs,
                        "logprob": logprob(idx),
                        "text": tok.decode_one(ids[idx]),
                        "bytes": list(tok.piece(ids[idx])),
                    }
                )
            if ge > end:
                keep.append((idx, gs, ge))
        if spans:
            segments.append({"text": text, "tokens": spans, "confidence": None})
        pending = keep
        done = max(done, end)
        delta: dict[str, Any] = {"content": text}
        if k == 0:
            delta = {"role": "assistant", **delta}
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": "stop" if k == len(ids) - 1 else None,
        }
        ext = {
            "token": {
                "index": k,
                "id": tid,
                "text": tok.decode_one(tid),
                "bytes": list(tok.piece(tid)),
                "logprob": logprob(k),
            },
            "segments": segments,
        }
        chunks.append({**env, "choices": [choice], "tokentrail": ext})
    return chunks, {"ids": ids, "content": tok.decode(ids), "refused": []}

