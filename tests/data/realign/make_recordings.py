"""Build the recorded chunk sequences in this folder, reproducibly.

    python tests/data/realign/make_recordings.py [--out DIR]

Each recording is what one server streams for one generation: a text from several
scripts (emoji, CJK, accents) is encoded with a real tokenizer from ../shared/corpus, and
the generated ids are emitted as chunks following that project's documented wire format
and its source's emission logic (docs/realign.md cites both). tokentrail itself is not
used: token bytes come from the tokenizer files (the byte-level alphabet, SentencePiece
pieces), texts from the tokenizer libraries' own decode.

MANIFEST.json lists, for every recording, its tokenizer, the generated ids, the streamed
content, and the token indices a faithful realignment must refuse to attribute (those a
lossy server sent no usable data for).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
CORPUS = Path(os.environ.get("TOKENTRAIL_CORPUS", REPO.parent / "shared" / "corpus"))

TEXT = "Hi 🙂 你好, 世界! Crème brûlée… 🦙🇫🇷 ok"
PROMPT = "Say hello in three scripts:"
CREATED = 1_700_000_000
N_TOP = 3


# -- tokenizers, read straight from their files ----------------------------------------------


def gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable char -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


class Tok:
    """The few things a recording needs from a tokenizer, from the library itself."""

    def __init__(self, rel: str) -> None:
        self.rel = rel
        path = CORPUS / "tokenizers" / rel
        if rel.endswith(".json"):
            from tokenizers import Tokenizer

            self.hf = Tokenizer.from_file(str(path))
            self.sp = None
            self.size = self.hf.get_vocab_size()
            added = self.hf.get_added_tokens_decoder()
            self.specials = {i for i, t in added.items() if t.special}
            self.added = {i: t.content for i, t in added.items()}
            self.eos = self.hf.token_to_id("<|endoftext|>")
            self._alphabet = gpt2_byte_alphabet()
        else:
            import sentencepiece as spm

            self.hf = None
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
            self.size = self.sp.get_piece_size()
            self.specials = {
                i for i in range(self.size) if self.sp.is_control(i) or self.sp.is_unknown(i)
            }
            self.eos = self.sp.eos_id()

    def encode(self, text: str) -> list[int]:
        if self.hf is not None:
            return list(self.hf.encode(text, add_special_tokens=False).ids)
        return list(self.sp.encode(text))

    def decode(self, ids: list[int]) -> str:
        """The library's decode, special tokens skipped (what servers stream)."""
        if self.hf is not None:
            return self.hf.decode(ids, skip_special_tokens=True)
        return self.sp.decode(ids)

    def decode_one(self, tid: int) -> str:
        """One token decoded alone, as servers that report per-token strings do."""
        if self.hf is not None:
            return self.hf.decode([tid], skip_special_tokens=False)
        return self.sp.decode([tid])

    def name(self, tid: int) -> str:
        return self.hf.id_to_token(tid) if self.hf is not None else self.sp.id_to_piece(tid)

    def piece(self, tid: int) -> bytes:
        """A token's raw bytes mid-text (a special token's are its name's)."""
        if self.hf is not None:
            if tid in self.added:  # added tokens are stored as plain text
                return self.added[tid].encode()
            return bytes(self._alphabet[c] for c in self.hf.id_to_token(tid))
        name = self.sp.id_to_piece(tid)
        if self.sp.is_byte(tid):
            return bytes([int(name[3:5], 16)])
        if tid in self.specials:
            return b""
        return name.replace("\u2581", " ").encode()

    def plain_alternatives(self, tid: int, k: int) -> list[int]:
        """Deterministic, distinct, non-special alternatives to `tid` at step `k`."""
        out = [tid]
        step = 0
        while len(out) < N_TOP:
            step += 1
            alt = (tid * (7 + 4 * step) + 131 * k + 17 * step) % self.size
            if alt not in out and alt not in self.specials:
                out.append(alt)
        return out


def logprob(k: int, rank: int = 0) -> float:
    """A deterministic logprob for step `k`'s candidate of rank `rank`."""
    base = -(0.015 + 1.6 * ((k * 37) % 19) / 19)
    return round(base - 1.25 * rank - 0.1 * rank * rank, 6)


def valid_prefix(data: bytes) -> bytes:
    """`data` without an incomplete character at its end (llama.cpp's validate_utf8)."""
    return data[: len(data) - _incomplete_tail(data)]


def _incomplete_tail(data: bytes) -> int:
    """Bytes of a character cut off at the end of `data`, by llama.cpp's validate_utf8:
    a lead byte among the last four with fewer bytes after it than it needs."""
    n = len(data)
    for i in range(1, min(4, n) + 1):
        c = data[n - i]
        if (c & 0xE0 == 0xC0 and i < 2) or (c & 0xF0 == 0xE0 and i < 3):
            return i
        if c & 0xF8 == 0xF0 and i < 4:
            return i
    return 0


def openai_token(piece: bytes) -> str:
    """OpenAI's token string: the text, or ``bytes:\\xNN..`` when not valid UTF-8."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def deltas(tok: Tok, ids: list[int]) -> list[str]:
    """Per token, the text that became final with it (vLLM's incremental detokenizer rule:
    a decode that ends in U+FFFD waits for more tokens)."""
    out = []
    prev = ""
    for k in range(len(ids)):
        full = tok.decode(ids[: k + 1])
        if full.endswith("\ufffd"):
            out.append("")
            continue
        out.append(full[len(prev) :])
        prev = full
    return out


def openai_envelope(obj: str, rid: str, model: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": CREATED, "model": model}


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
        if _incomplete_tail(generated):
            dropped.append(k)
            continue
        text = generated[sent:]
        sent = len(generated)
        alts = tok.plain_alternatives(tid, k)
        prob = {
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
        end = pos - _incomplete_tail(stream)
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


Recording = Callable[[], tuple[list[dict[str, Any]], dict[str, Any]]]


def recordings() -> dict[str, tuple[str, str, str, Recording]]:
    """name -> (tokenizer, format, documentation, builder)."""
    gpt2 = Tok("gpt2/tokenizer.json")
    neox = Tok("gpt-neox/20B_tokenizer.json")
    llama2 = Tok("llama2/tokenizer.model")
    oai_chat = "OpenAI API reference: chat streaming, ChatCompletionTokenLogprob"
    oai_cmpl = "OpenAI API reference: legacy completions, logprobs; 'bytes:\\x..' token form"
    vllm = "vllm/entrypoints/openai/{chat_completion,completion}/protocol.py and serving.py"
    llama = "llama.cpp tools/server/README.md (/completion) and server-context.cpp process_token"
    return {
        "openai_chat_logprobs": (gpt2.rel, "openai-chat", oai_chat, lambda: openai_chat(gpt2)),
        "openai_completions_logprobs": (
            gpt2.rel,
            "openai-completions",
            oai_cmpl,
            lambda: openai_completions(gpt2),
        ),
        "vllm_chat_return_token_ids": (
            neox.rel,
            "vllm-chat",
            vllm,
            lambda: vllm_chat(neox, token_ids=True, as_ids=False),
        ),
        "vllm_completions_return_token_ids": (
            neox.rel,
            "vllm-completions",
            vllm,
            lambda: vllm_completions(neox, token_ids=True, as_ids=False),
        ),
        "vllm_chat_tokens_as_token_ids": (
            neox.rel,
            "vllm-chat",
            vllm,
            lambda: vllm_chat(neox, token_ids=False, as_ids=True),
        ),
        "vllm_completions_tokens_as_token_ids": (
            neox.rel,
            "vllm-completions",
            vllm,
            lambda: vllm_completions(neox, token_ids=False, as_ids=True),
        ),
        "vllm_chat_logprobs_lossy": (
            gpt2.rel,
            "vllm-chat",
            vllm,
            lambda: vllm_chat(gpt2, token_ids=False, as_ids=False),
        ),
        # Real llama.cpp recordings (byte-level BPE, SmolLM2) are in llamacpp/, made by
        # record_llamacpp.py; this one stays script-made for SentencePiece's leading-space
        # rule, as no SentencePiece GGUF model runs here.
        "llamacpp_completion_stream_spm": (
            llama2.rel,
            "llama.cpp-completion",
            llama,
            lambda: llama_completion(
                llama2, stream=True, return_tokens=False, rel_model="llama-2-7b.Q4_K_M.gguf"
            ),
        ),
        "tokentrail_extension_chat": (
            gpt2.rel,
            "tokentrail",
            "src/tokentrail/server.py module docstring",
            lambda: extension_chat(gpt2),
        ),
    }


def build(out: Path) -> list[dict[str, Any]]:
    """Write every recording and MANIFEST.json into `out`; return the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = []
    for name, (rel, fmt, doc, make) in recordings().items():
        chunks, truth = make()
        lines = [json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in chunks]
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        manifest.append(
            {
                "name": name,
                "file": f"{name}.jsonl",
                "tokenizer": rel,
                "format": fmt,
                "doc": doc,
                "lossy": bool(truth["refused"]),
                **truth,
            }
        )
    text = json.dumps(manifest, ensure_ascii=False, indent=1) + "\n"
    (out / "MANIFEST.json").write_text(text, encoding="utf-8")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write (default: here)")
    args = parser.parse_args()
    if not CORPUS.exists():
        raise SystemExit(f"tokenizer corpus not found at {CORPUS} (set TOKENTRAIL_CORPUS)")
    for entry in build(args.out):
        print(f"{entry['file']}: {len(entry['ids'])} tokens, refused {entry['refused']}")


if __name__ == "__main__":
    main()
