"""vLLM's extra request fields (`tokentrail.server.vllm_fields`), as a vLLM user sends
them through the official `openai` client's ``extra_body``.

On a real `tokentrail serve` (the demo model, MLX; a copy of it whose chat template
reads a variable) and on the proxy in front of llama-server. Oracles: the tokenizer's
own library (`tokenizers` decodes the ids, transformers renders the chat template with
the same variables and ``continue_final_message``) and each request without the field
(greedy decoding is deterministic, so a reply that runs past its end token shares its
tokens up to there). vLLM's own server on the same fields is in
`tests/test_vllm_server.py`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import require

openai = require("openai")
require("uvicorn")

from tests.helpers.responses import extension_ids  # noqa: E402
from tests.helpers.servers import Server, start_llama_server, start_server  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"
ASK = [{"role": "user", "content": "What is a list?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(None, tmp_path_factory.mktemp("logs") / "vllm-fields.log")
    yield srv
    srv.stop()


def _chat(server: Server, messages: list[dict[str, Any]] = ASK, **extra: Any) -> Any:
    options = {k: extra.pop(k) for k in ("max_tokens", "stream", "n") if k in extra}
    return server.client().chat.completions.create(
        model=server.model, messages=messages, temperature=0, extra_body=extra,
        **{"max_tokens": 40, **options},
    )  # fmt: skip


def _end_ids() -> list[int]:
    """The model's end tokens, from its generation config (transformers' own rule)."""
    ids = json.loads((DEMO / "generation_config.json").read_text())["eos_token_id"]
    return [ids] if isinstance(ids, int) else list(ids)


def _ended_early(server: Server) -> tuple[dict[str, Any], Any]:
    """Options (a bias on one end token) with which the demo model ends its reply with
    that token after a few tokens: the tiny model rarely does on its own."""
    for end in _end_ids():
        for step in range(1, 120):
            options = {"logit_bias": {str(end): step / 8}}
            reply = _chat(server, **options)
            n = reply.usage.completion_tokens
            if reply.choices[0].finish_reason == "stop" and 3 <= n < 30:
                return options, reply
    pytest.fail("no bias made the demo model end its reply after a few tokens")


def test_ignore_eos_runs_to_max_tokens_through_the_end_token(server: Server) -> None:
    options, plain = _ended_early(server)
    ids = extension_ids(plain)
    assert ids[-1] in _end_ids()
    longer = _chat(server, ignore_eos=True, **options)
    assert longer.choices[0].finish_reason == "length"
    assert longer.usage.completion_tokens == 40
    # greedy: the same tokens up to and including the end token, which no longer ends it
    assert extension_ids(longer)[: len(ids)] == ids
    assert longer.choices[0].message.content.startswith(plain.choices[0].message.content)


def test_stop_token_ids_end_the_reply_at_the_id(server: Server) -> None:
    """As vLLM's stop-terminated replies: the id is the last listed, its text left out."""
    from tokenizers import Tokenizer

    plain = _chat(server)
    ids = extension_ids(plain)
    at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # first occurrence
    stopped = _chat(server, stop_token_ids=[ids[at], 0])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and extension_ids(stopped) == ids[: at + 1]
    decoded = Tokenizer.from_file(str(DEMO / "tokenizer.json")).decode(ids[:at])
    assert choice.message.content == decoded


def test_skip_special_tokens_false_keeps_special_tokens_text(server: Server) -> None:
    from tokenizers import Tokenizer

    options, _ = _ended_early(server)
    ref = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    hidden = _chat(server, ignore_eos=True, **options)
    shown = _chat(server, ignore_eos=True, skip_special_tokens=False, **options)
    ids = extension_ids(shown)
    assert ids == extension_ids(hidden) and set(ids) & set(_end_ids())
    assert shown.choices[0].message.content == ref.decode(ids, skip_special_tokens=False)
    assert hidden.choices[0].message.content == ref.decode(ids, skip_special_tokens=True)
    assert shown.choices[0].message.content != hidden.choices[0].message.content


def test_return_token_ids_in_vllms_places(server: Server) -> None:
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(str(DEMO)).apply_chat_template(
        ASK, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    whole = _chat(server, return_token_ids=True)
    assert whole.model_extra["prompt_token_ids"] == list(prompt)
    assert whole.choices[0].model_extra["token_ids"] == extension_ids(whole)
    chunks = list(_chat(server, return_token_ids=True, stream=True))
    assert chunks[0].model_extra["prompt_token_ids"] == list(prompt)
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    streamed = [i for c in chunks if c.choices for i in c.choices[0].model_extra["token_ids"]]
    assert streamed == extension_ids(whole)
    completion = server.client().completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=5, temperature=0,
        extra_body={"return_token_ids": True, "add_special_tokens": False},
    )  # fmt: skip
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    choice = completion.choices[0].model_extra
    assert choice["prompt_token_ids"] == ref.encode("The capital of France is",
                                                    add_special_tokens=False).ids  # fmt: skip
    assert choice["token_ids"] == extension_ids(completion)


def test_continue_final_message_renders_as_transformers(server: Server) -> None:
    from transformers import AutoTokenizer

    messages = [*ASK, {"role": "assistant", "content": "A list is"}]
    expected = AutoTokenizer.from_pretrained(str(DEMO)).apply_chat_template(
        messages, continue_final_message=True, tokenize=True, return_dict=False
    )
    reply = _chat(server, messages, continue_final_message=True, add_generation_prompt=False,
                  return_token_ids=True)  # fmt: skip
    assert reply.model_extra["prompt_token_ids"] == list(expected)
    # add_generation_prompt false alone: the template's rendering without the prompt
    plain = AutoTokenizer.from_pretrained(str(DEMO)).apply_chat_template(
        ASK, add_generation_prompt=False, tokenize=True, return_dict=False
    )
    bare = _chat(server, add_generation_prompt=False, return_token_ids=True, max_tokens=2)
    assert bare.model_extra["prompt_token_ids"] == list(plain)


@pytest.fixture(scope="module")
def templated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """The demo model with a chat template that reads a variable (as Qwen3's reads
    ``enable_thinking``)."""
    folder = tmp_path_factory.mktemp("templated") / "model"
    shutil.copytree(DEMO, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if note is defined %}{{ '<|im_start|>system\\n' + note + '<|im_end|>\\n' }}"
        "{% endif %}" + config["chat_template"]
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    srv = start_server(folder, tmp_path_factory.mktemp("logs") / "templated.log")
    yield srv, folder
    srv.stop()


def test_chat_template_kwargs_reach_the_template(templated: tuple[Server, Path]) -> None:
    from transformers import AutoTokenizer

    srv, folder = templated
    ref = AutoTokenizer.from_pretrained(str(folder))
    with_note = ref.apply_chat_template(ASK, add_generation_prompt=True, note="Be brief.",
                                        tokenize=True, return_dict=False)  # fmt: skip
    without = ref.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)  # fmt: skip
    assert len(with_note) > len(without)
    got = _chat(srv, chat_template_kwargs={"note": "Be brief."}, return_token_ids=True,
                max_tokens=2)  # fmt: skip
    assert got.model_extra["prompt_token_ids"] == list(with_note)
    plain = _chat(srv, return_token_ids=True, max_tokens=2)
    assert plain.model_extra["prompt_token_ids"] == list(without)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"min_tokens": 4}, "min_tokens"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"bad_words": ["list"]}, "bad_words"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"stop_token_ids": "2"}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"continue_final_message": True, "add_generation_prompt": True},
         "continue_final_message"),
        ({"continue_final_message": True}, None),  # the last message is the user's
        ({"echo": True}, "echo"),
    ],
)  # fmt: skip
def test_fields_not_honoured_are_refused_by_name(
    server: Server, extra: dict[str, Any], param: str | None
) -> None:
    body = {"model": server.model, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    if param is None:
        assert "continue_final_message" in error["message"]


def test_fields_at_vllms_defaults_are_served(server: Server) -> None:
    """What a client sends that fills every field with vLLM's default."""
    defaults = {
        "min_tokens": 0, "use_beam_search": False, "length_penalty": 1.0, "bad_words": [],
        "include_stop_str_in_output": False, "spaces_between_special_tokens": True,
        "skip_special_tokens": True, "ignore_eos": False, "stop_token_ids": [],
        "prompt_logprobs": None, "priority": 0, "echo": False, "add_generation_prompt": True,
        "continue_final_message": False, "request_id": "abc", "chat_template_kwargs": {},
    }  # fmt: skip
    assert extension_ids(_chat(server, **defaults)) == extension_ids(_chat(server))


def test_ignore_eos_through_the_proxy(
    demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """llama-server takes ``ignore_eos`` (it then never picks an end token); an upstream
    spoken to as plain OpenAI cannot be asked, so the request is refused by name."""
    logs = tmp_path_factory.mktemp("logs")
    llama = start_llama_server(demo_gguf, logs / "llama-server.log")
    proxy = start_server(None, logs / "proxy.log", "--upstream", llama.url,
                         "--tokenizer", str(DEMO))  # fmt: skip
    plain_openai = start_server(
        None, logs / "proxy-openai.log", "--upstream", llama.url, "--tokenizer", str(DEMO),
        "--upstream-dialect", "openai",
    )  # fmt: skip
    try:
        options, plain = _ended_early(proxy)
        longer = _chat(proxy, ignore_eos=True, **options)
        assert longer.choices[0].finish_reason == "length"
        assert longer.usage.completion_tokens == 40
        ids = extension_ids(plain)
        assert extension_ids(longer)[: len(ids) - 1] == ids[:-1]
        # llama-server masks its end tokens
        assert not set(_end_ids()) & set(extension_ids(longer))
        body = {"model": plain_openai.model, "messages": ASK, "max_tokens": 4,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(plain_openai.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "ignore_eos"
    finally:
        plain_openai.stop()
        proxy.stop()
        llama.stop()
