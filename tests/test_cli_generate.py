"""`tokentrail generate` in a subprocess: the chat template by default, --system, --no-chat.

The prompt lengths the CLI reports are checked against the model's own tokenizer
(transformers' `apply_chat_template` and `tokenizers`' `encode`), so the test fails if
the CLI sends the wrong prompt. mlx_lm.generate applies the chat template by default
when the tokenizer has one (mlx-lm: mlx_lm/generate.py, `--ignore-chat-template`);
these tests hold tokentrail to the same behaviour.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm", reason="the demo model runs on MLX: pip install -e '.[mlx]'")

DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"
PROMPT = "What is a list?"


def generate(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokentrail", "generate", *args],
        capture_output=True, text=True, timeout=180, input=stdin,
    )


def prompt_tokens(r: subprocess.CompletedProcess[str]) -> int:
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout.splitlines()[0])
    return int(first["prompt_tokens"])


def chat_length(messages: list[dict[str, str]]) -> int:
    """Prompt length by the reference: transformers renders, tokenizers encodes."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(DEMO)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return len(Tokenizer.from_file(str(DEMO / "tokenizer.json")).encode(text).ids)


def raw_length(text: str) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(DEMO / "tokenizer.json")).encode(text).ids)


def test_chat_template_applies_by_default_and_no_chat_turns_it_off() -> None:
    expected_chat = chat_length([{"role": "user", "content": PROMPT}])
    assert expected_chat > raw_length(PROMPT)  # the template adds tokens: a real difference
    assert prompt_tokens(generate("--max-tokens", "1", "--json", PROMPT)) == expected_chat
    assert prompt_tokens(generate("--max-tokens", "1", "--json", "--chat", PROMPT)) == (
        expected_chat
    )
    for flag in ("--no-chat", "--raw"):
        r = generate("--max-tokens", "1", "--json", flag, PROMPT)
        assert prompt_tokens(r) == raw_length(PROMPT), flag


def test_system_prompt_goes_before_the_user_message() -> None:
    system = "Answer in one sentence."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": PROMPT}]
    r = generate("--max-tokens", "1", "--json", "--system", system, PROMPT)
    assert prompt_tokens(r) == chat_length(messages)


def test_prompt_from_stdin_goes_through_the_template() -> None:
    r = generate("--max-tokens", "1", "--json", stdin=PROMPT + "\n")
    assert prompt_tokens(r) == chat_length([{"role": "user", "content": PROMPT}])


def test_system_with_no_chat_exits_2_before_loading() -> None:
    r = generate("--no-chat", "--system", "be brief", PROMPT)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "--system" in r.stderr and "--no-chat" in r.stderr


def test_chat_and_no_chat_together_exit_2() -> None:
    r = generate("--chat", "--no-chat", PROMPT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not allowed with" in r.stderr


@pytest.fixture(scope="module")
def untemplated_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model without its chat template (a base model, as far as the CLI knows)."""
    folder = tmp_path_factory.mktemp("base") / "model"
    shutil.copytree(DEMO, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template")
    config_path.write_text(json.dumps(config))
    return folder


def test_model_without_template_gets_plain_text(untemplated_model: Path) -> None:
    r = generate("--model", str(untemplated_model), "--max-tokens", "1", "--json", PROMPT)
    assert prompt_tokens(r) == raw_length(PROMPT)


@pytest.mark.parametrize(("flags", "needle"), [
    (["--chat"], "no chat template"),
    (["--system", "be brief"], "--system needs a chat template"),
])
def test_template_options_on_a_model_without_one_exit_2(
    untemplated_model: Path, flags: list[str], needle: str
) -> None:
    r = generate("--model", str(untemplated_model), *flags, PROMPT)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr


def test_verbose_before_and_after_the_subcommand() -> None:
    def stderr_of(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "tokentrail", *args], capture_output=True,
                           text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        return r.stderr

    quiet = ["generate", "--max-tokens", "1", "--json", PROMPT]
    assert "loaded" not in stderr_of(*quiet)
    assert "loaded the demo model with the mlx engine" in stderr_of("-v", *quiet)
    assert "loaded the demo model with the mlx engine" in stderr_of(*quiet[:1], "-v", *quiet[1:])


def test_penalty_and_min_p_flags_reach_the_sampler() -> None:
    """`--presence-penalty`, `--frequency-penalty` and `--repetition-penalty`: the
    greedy tokens equal mlx-lm's own `generate_step` with its `make_logits_processors`
    on the same model and prompt (the oracle), and differ from those without the flags.
    (`--min-p` rides along: a filter that always keeps the likeliest token leaves a
    greedy choice as it is.)"""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    import tokentrail

    text, n = "the the the cat sat on the mat and the cat", 24
    flags = ["--presence-penalty", "1", "--frequency-penalty", "0.6",
             "--repetition-penalty", "1.3", "--min-p", "0.05"]  # fmt: skip
    r = generate("--json", "--no-chat", "--max-tokens", str(n), *flags, text)
    assert r.returncode == 0, r.stderr
    mine = [json.loads(line)["token"] for line in r.stdout.splitlines()]
    model, tok = tokentrail.load()
    processors = make_logits_processors(
        repetition_penalty=1.3, presence_penalty=1.0, frequency_penalty=0.6
    )
    theirs = [int(t) for t, _ in generate_step(
        mx.array(tok.encode(text)), model, max_tokens=n, logits_processors=processors,
        sampler=lambda x: mx.argmax(x, axis=-1),
    )]  # fmt: skip
    assert mine == theirs[: len(mine)] and len(mine) >= 8
    plain = generate("--json", "--no-chat", "--max-tokens", str(n), text)
    assert [json.loads(line)["token"] for line in plain.stdout.splitlines()] != mine


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [("--presence-penalty", "3", "presence_penalty"),
     ("--frequency-penalty", "-2.5", "frequency_penalty"),
     ("--repetition-penalty", "0", "repetition_penalty"),
     ("--min-p", "1.5", "min_p")],
)  # fmt: skip
def test_bad_sampling_flags_exit_2_naming_the_setting(flag: str, value: str, named: str) -> None:
    r = generate(flag, value, PROMPT)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and named in r.stderr, r.stderr
