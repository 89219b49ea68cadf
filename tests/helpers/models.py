"""The one tiny random-weight Llama the tests build, and its tokenizer files.

Used where the built-in demo model is absent, and where a test needs what the demo
model is not: a byte-level tokenizer (one token per byte: random weights emit arbitrary
bytes, so most multi-byte characters come out incomplete or invalid) or an unbounded
context. Weights are written with mlx (`framework="mlx"`) or saved by transformers
(`framework="torch"`); the frameworks are imported when a model is built.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import CORPUS

#: A plain chat template for a GPT-2 style tokenizer.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
#: ChatML, for the byte-level tokenizer (which has <|im_start|> and <|im_end|>).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BYTE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def gpt2_tokenizer_json() -> Path:
    """GPT-2's tokenizer.json from the corpus, for a tiny model where the demo model is
    absent; skip the calling test when it is not there either."""
    tok = CORPUS / "tokenizers" / "gpt2" / "tokenizer.json"
    if not tok.is_file():
        pytest.skip(f"no demo model and no GPT-2 tokenizer at {tok} to build a tiny one")
    return tok


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


def write_byte_tokenizer(out: Path) -> int:
    """A byte-level BPE with no merges (one token per byte) after three specials, with
    ChatML and <|im_end|> as EOS; return its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {s: i for i, s in enumerate(BYTE_SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(BYTE_SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHATML,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return len(vocab)


def build_tiny_llama(
    out: Path,
    tokenizer_json: Path | None = None,
    *,
    framework: str = "mlx",
    hidden_size: int = 32,
    intermediate_size: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    context: int = 4096,
    rms_norm_eps: float = 1e-5,
    tie: bool | None = None,
    lm_head_scale: float = 1.0,
    extra_eos: int | None = None,
    chat_template: str | None = CHAT_TEMPLATE,
) -> Path:
    """A 2-layer random-weight Llama (seed 0) in `out`.

    Without `tokenizer_json`: over the byte-level tokenizer (`write_byte_tokenizer`),
    embeddings tied unless `tie` says otherwise. With it (a GPT-2 style tokenizer.json):
    over that tokenizer, <|endoftext|> as BOS and EOS, `chat_template`, untied.
    `lm_head_scale` (mlx) scales the output layer for peaked but varied distributions;
    the torch weights are drawn larger for the same reason. `extra_eos` (torch) adds a
    second end token to the generation config, as chat models have.
    """
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_json is None:
        size, bos, eos = write_byte_tokenizer(out), None, BYTE_SPECIALS.index("<|im_end|>")
        tie = True if tie is None else tie
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_json))
        size, bos = tok.get_vocab_size(), tok.token_to_id("<|endoftext|>")
        eos = bos
        write_tokenizer_files(out, tokenizer_json, chat_template)
        tie = False if tie is None else tie
    config: dict[str, Any] = {
        "vocab_size": size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": context, "rms_norm_eps": rms_norm_eps,
        "tie_word_embeddings": tie, "eos_token_id": eos,
    }  # fmt: skip
    if bos is not None:
        config["bos_token_id"] = bos
    if framework == "mlx":
        _save_mlx(out, config, lm_head_scale)
    elif framework == "torch":
        _save_torch(out, config, extra_eos)
    else:
        raise ValueError(f"framework must be 'mlx' or 'torch', not {framework!r}")
    return out


def _save_mlx(out: Path, config: dict[str, Any], lm_head_scale: float) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], **config,
        "rope_theta": 10000.0, "torch_dtype": "float32",
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config), encoding="utf-8")
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    if lm_head_scale != 1.0:
        weights["lm_head.weight"] = weights["lm_head.weight"] * lm_head_scale
    mx.save_safetensors(str(out / "model.safetensors"), weights)


def _save_torch(out: Path, config: dict[str, Any], extra_eos: int | None) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**config))
        with torch.no_grad():
            # Larger weights give peaked, varied next-token distributions.
            model.model.embed_tokens.weight.normal_(0.0, 1.0)
            model.lm_head.weight.normal_(0.0, 0.5)
    if extra_eos is not None:
        eos = config["eos_token_id"]
        model.generation_config = GenerationConfig(
            bos_token_id=config.get("bos_token_id"), eos_token_id=[eos, extra_eos]
        )
    model.save_pretrained(out)


def special_ids(model_dir: Path) -> list[int]:
    """The ids of the special tokens a model folder's tokenizer.json declares."""
    data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return sorted(t["id"] for t in data.get("added_tokens", []) if t.get("special"))


def eos_id(model_dir: Path) -> int:
    """The id of the end-of-sequence token, as the model folder declares it."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            if isinstance(eos, list) and eos:
                return int(eos[0])
            if isinstance(eos, int):
                return eos
    raise AssertionError(f"no eos_token_id in {model_dir}")
