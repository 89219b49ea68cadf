"""Shared by the tests that build a tiny random-weight model when the demo model is absent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


def write_tokenizer_files(
    out: Path, tokenizer_json: Path, chat_template: str | None = CHAT_TEMPLATE
) -> None:
    """Copy a byte-level tokenizer.json into `out` with a GPT-2 style tokenizer_config."""
    shutil.copy(tokenizer_json, out / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
