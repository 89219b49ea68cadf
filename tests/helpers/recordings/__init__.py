"""The recorded chunk sequences of tests/data/realign, built reproducibly.

Each recording is what one server streams for one generation: a text from several
scripts (emoji, CJK, accents) is encoded with a real tokenizer from ../shared/corpus, and
the generated ids are emitted as chunks following that project's documented wire format
and its source's emission logic (docs/realign.md cites both). tokentrail itself is not
used: token bytes come from the tokenizer files (the byte-level alphabet, SentencePiece
pieces), texts from the tokenizer libraries' own decode.

MANIFEST.json lists, for every recording, its tokenizer, the generated ids, the streamed
content, and the token indices a faithful realignment must refuse to attribute (those a
lossy server sent no usable data for). tests/data/realign/make_recordings.py writes them;
tests/test_realign.py checks that they are reproduced byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.helpers.recordings.formats import (
    extension_chat,
    llama_completion,
    openai_chat,
    openai_completions,
    vllm_chat,
    vllm_completions,
)
from tests.helpers.recordings.tokens import PROMPT, Tok, logprob

__all__ = ["PROMPT", "Tok", "build", "logprob", "recordings"]

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

