"""Record real llama.cpp `llama-server` streams for the realign tests, with ground truth.

    python -m tests.data.realign.llamacpp.record_llamacpp --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
        [--server PATH/llama-server] [--out DIR]     (from the repository root)

The server is llama.cpp's own `llama-server` as bundled in llama-cpp-python 0.3.36's sdist
(`llama-server --version`: "version: 0.5.0-dev (build 0, commit unknown)", built by
scripts/build_llama_server.sh), started here on loopback with

    llama-server -m GGUF --host 127.0.0.1 --port FREE -c 2048 -np 1 -t 2 --no-webui

For every prompt (CJK, emoji, code) and temperature (0, and 1.5 with a fixed seed) it
records three streams, as the server sent them (one parsed SSE ``data:`` object a line):

- ``/completion`` with ``n_probs`` (llama.cpp's native endpoint),
- ``/v1/completions`` with ``logprobs``,
- ``/v1/chat/completions`` with ``logprobs`` and ``top_logprobs`` (and ``stream_options``
  ``include_usage``),

and, as ground truth, the same generation once more without streaming from
``/completion`` with ``return_tokens`` and ``n_probs`` (the prompt is the chat template
applied by the server's ``/apply-template``, so all four see the same prompt tokens, and
``cache_prompt`` is off). A recording is kept only if the stream's content equals the
ground truth's, so the generation is known to be the same one.

The demo model's recordings (../llamacpp_demo/) were made the same way from the built-in
demo model converted with llama.cpp's own converter (the sdist's
vendor/llama.cpp/convert_hf_to_gguf.py, with `get_vocab_base_pre` answering "gpt-2", as
the demo tokenizer is GPT-2-style byte-level and its hash is not in llama.cpp's list):

    python convert_hf_to_gguf.py src/tokentrail/demo_model --outtype f32 --outfile demo.gguf
    python -m tests.data.realign.llamacpp.record_llamacpp --gguf demo.gguf \
        --out tests/data/realign/llamacpp_demo

MANIFEST.json then lists, per recording: the ground-truth ids and per-token bytes
(llama.cpp's own), the content, ``usage``'s count, and ``dropped``: the indices of the
tokens the stream carried no id for, worked out here from the wire alone (a /completion
frame's ``tokens`` are its last ``len(tokens)`` of ``tokens_predicted``; an OpenAI-style
entry's ``bytes`` are its own token's bytes plus those of the tokens whose frames were
folded into it). tokentrail is not used.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from tests.helpers.net import free_port
from tests.helpers.recordings.tokens import gpt2_byte_alphabet

HERE = Path(__file__).resolve().parent
SERVER = Path.home() / ".cache/tokentrail/llama.cpp-0.3.36/build/bin/llama-server"
PROMPTS = {
    "cjk": "用中文写一句关于春天的话。",
    "emoji": "Reply with three emoji and the word 你好.",
    "code": "Write a Python function that reverses a string. Only code.",
    "mixed": "Write 'good morning' in Japanese, Korean and Chinese, each with an emoji.",
}
TEMPS = {"t0": 0.0, "t15": 1.5}
SEED = 7
N = 40
TOP = 3


def gguf_pieces(path: Path) -> list[bytes]:
    """Each token's bytes as llama.cpp streams them, read with the `gguf` package: the
    byte-level token strings mapped back to bytes; control tokens add nothing."""
    import gguf

    reader = gguf.GGUFReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    types = reader.fields["tokenizer.ggml.token_type"]
    alphabet = gpt2_byte_alphabet()
    out = []
    for k, i in enumerate(tokens.data):
        text = bytes(tokens.parts[i]).decode("utf-8")
        kind = int(types.parts[types.data[k]][0])
        out.append(b"" if kind == 3 else bytes(alphabet[c] for c in text))
    return out


def sse(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    # A fresh connection per stream: llama-server 0.5.0-dev exits when a chat stream
    # follows other streams on one kept-alive connection.
    with (
        httpx.Client(base_url=client.base_url, timeout=client.timeout) as fresh,
        fresh.stream("POST", path, json=body) as r,
    ):
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def sampling(temp: float) -> dict[str, Any]:
    return {"temperature": temp, "seed": SEED, "cache_prompt": False}


def dropped_native(frames: list[dict[str, Any]], total: int) -> list[int]:
    sent: set[int] = set()
    for f in frames:
        ids = f.get("tokens") or []
        n = f.get("tokens_predicted")
        if ids and isinstance(n, int):
            sent.update(range(n - len(ids), n))
    return sorted(set(range(total)) - sent)


def dropped_openai(entries: list[dict[str, Any]], truth: list[tuple[int, bytes]]) -> list[int]:
    """Walk the ground truth: each entry covers its own token and the folded ones before."""
    sent = []
    pos = 0
    for e in entries:
        want = bytes(e["bytes"])
        acc = b""
        start = pos
        while pos < len(truth) and (pos == start or len(acc) < len(want)):
            acc += truth[pos][1]
            pos += 1
        if acc != want or truth[pos - 1][0] != e["id"]:
            raise SystemExit(f"entry {e['id']} {list(want)} does not fit the truth at {start}")
        sent.append(pos - 1)
    return sorted(set(range(len(truth))) - set(sent))


def streams(client: httpx.Client, prompt: str, messages: list[Any], temp: float) -> dict:
    """The same generation streamed from the three endpoints: kind -> parsed chunks."""
    return {
        "completion": sse(
            client,
            "/completion",
            {"prompt": prompt, "n_predict": N, "n_probs": TOP, "stream": True, **sampling(temp)},
        ),
        "v1_completions": sse(
            client,
            "/v1/completions",
            {
                "prompt": prompt,
                "max_tokens": N,
                "logprobs": TOP,
                "stream": True,
                "stream_options": {"include_usage": True},
                **sampling(temp),
            },
        ),
        "v1_chat": sse(
            client,
            "/v1/chat/completions",
            {
                "messages": messages,
                "max_tokens": N,
                "logprobs": True,
                "top_logprobs": TOP,
                "stream": True,
                "stream_options": {"include_usage": True},
                **sampling(temp),
            },
        ),
    }


def read_stream(
    kind: str, chunks: list[dict[str, Any]], pairs: list[tuple[int, bytes]]
) -> tuple[str, int | None, list[int]]:
    """(content, completion token count, dropped indices) of one recorded stream."""
    if kind == "completion":
        content = "".join(c.get("content", "") for c in chunks)
        return content, chunks[-1]["tokens_predicted"], dropped_native(chunks, len(pairs))
    content = ""
    entries: list[dict[str, Any]] = []
    total = None
    for c in chunks:
        for ch in c.get("choices") or []:
            content += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            entries += ((ch.get("logprobs") or {}).get("content")) or []
        if c.get("usage"):
            total = c["usage"]["completion_tokens"]
    return content, total, dropped_openai(entries, pairs)


def record(
    client: httpx.Client, vocab: list[bytes], out: Path, pname: str, text: str
) -> list[dict[str, Any]]:
    """Record prompt `text` at every temperature into `out`; return its manifest entries."""
    manifest = []
    messages = [{"role": "user", "content": text}]
    prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
    for tname, temp in TEMPS.items():
        truth = client.post(
            "/completion",
            json={
                "prompt": prompt,
                "n_predict": N,
                "n_probs": 1,
                "return_tokens": True,
                "stream": False,
                **sampling(temp),
            },
        ).json()
        ids = truth["tokens"]
        # Not from completion_probabilities: llama.cpp folds those even here.
        pieces = [vocab[i] for i in ids]
        pairs = list(zip(ids, pieces, strict=True))
        for kind, chunks in streams(client, prompt, messages, temp).items():
            content, total, dropped = read_stream(kind, chunks, pairs)
            name = f"llamacpp_{kind}_{pname}_{tname}"
            # The ids' own bytes; a length-limited stream never sends an incomplete
            # last character.
            expected = b"".join(pieces).decode("utf-8", "ignore")
            if content != expected or total != len(ids):
                print(
                    f"skipped {name}: not the ground truth's generation:"
                    f" {content[-12:]!r} vs {truth['content'][-12:]!r}, {total}"
                )
                continue
            (out / f"{name}.jsonl").write_text(
                "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chunks),
                encoding="utf-8",
            )
            manifest.append(
                {
                    "name": name,
                    "file": f"{name}.jsonl",
                    "endpoint": kind,
                    "prompt": text,
                    "temperature": temp,
                    "seed": SEED,
                    "ids": ids,
                    "bytes": [list(p) for p in pieces],
                    "content": content,
                    "completion_tokens": total,
                    "stop_type": truth.get("stop_type"),
                    "dropped": dropped,
                }
            )
            print(f"{name}: {len(ids)} tokens, {len(dropped)} dropped")
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--server", type=Path, default=SERVER)
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--log", action="store_true", help="keep the server log in OUT/server.log")
    ap.add_argument("--folds", action="store_true",
                    help="record the fold streams (default --out: ../llamacpp_folds)")
    args = ap.parse_args()
    if args.folds:
        if args.out == HERE:
            args.out = HERE.parent / "llamacpp_folds"
        record_folds(args)
        return
    vocab = gguf_pieces(args.gguf)
    port = free_port()
    cmd = [str(args.server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-c", "2048", "-np", "1", "-t", "2", "--no-webui"]
    log = (args.out / "server.log").open("wb") if args.log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    manifest = []
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        for _ in range(600):
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        for pname, text in PROMPTS.items():
            manifest += record(client, vocab, args.out, pname, text)
    finally:
        proc.terminate()
        proc.wait(10)
    (args.out / "MANIFEST.json").write_text(
        json.dumps(
            {
                "server": "llama-server 0.5.0-dev (llama-cpp-python 0.3.36 sdist)",
                "model": args.gguf.name,
                "recordings": manifest,
            },
            indent=1,
            ensure_ascii=False,
        )
        + "\n",
        encoding="utf-8",
    )


# -- --folds: streams that fold, for the position tests (../llamacpp_folds) ---------------------
#
# Each is greedy: "stop", a stop string that starts inside one token and ends inside the
# next (chosen from the greedy text, "n fro" for SmolLM2): llama.cpp sends no entry for
# the token that straddles it and puts the text it held back on the entry of the token
# that completed the stop string; "emoji_nousage", emoji (several byte tokens folded into
# one entry each) without include_usage: nothing says how many tokens a fold held. Ground
# truth: the same request to /completion, not streamed, with return_tokens.

N_FOLDS = 24
FOLD_CASES: dict[str, dict[str, Any]] = {
    "stop": {"prompt": "Describe the history of mathematics in two sentences.",
             "stop": ["n fro"], "usage": True},
    "emoji_nousage": {"prompt": "Reply with three emoji and the word 你好.", "usage": False},
}  # fmt: skip



def record_folds(args: argparse.Namespace) -> None:
    """--folds: `/v1` streams that fold (see FOLD_CASES), into ../llamacpp_folds."""
    vocab = gguf_pieces(args.gguf)
    port = free_port()
    cmd = [str(args.server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-c", "2048", "-np", "1", "-t", "2", "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = []
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        for _ in range(600):
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        for case, spec in FOLD_CASES.items():
            messages = [{"role": "user", "content": spec["prompt"]}]
            prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
            stop = spec.get("stop") or []
            truth = client.post("/completion", json={
                "prompt": prompt, "n_predict": N_FOLDS, "temperature": 0, "return_tokens": True,
                "stream": False, "cache_prompt": False, "stop": stop}).json()  # fmt: skip
            body: dict[str, Any] = {"messages": messages, "max_tokens": N_FOLDS, "temperature": 0,
                                    "logprobs": True, "top_logprobs": 2, "stream": True}
            if stop:
                body["stop"] = stop
            if spec["usage"]:
                body["stream_options"] = {"include_usage": True}
            chunks = sse(client, "/v1/chat/completions", body)
            content = "".join((ch.get("delta") or {}).get("content") or ""
                              for c in chunks for ch in c.get("choices") or [])
            total = next((c["usage"]["completion_tokens"] for c in chunks if c.get("usage")),
                         None)  # fmt: skip
            name = f"llamacpp_folds_v1_chat_{case}"
            if content != truth["content"]:
                print(f"skipped {name}: {content!r} is not {truth['content']!r}")
                continue
            (args.out / f"{name}.jsonl").write_text(
                "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chunks), "utf-8"
            )
            ids = truth["tokens"]
            manifest.append({"name": name, "file": f"{name}.jsonl", "endpoint": "v1_chat",
                             "prompt": spec["prompt"], "stop": stop, "temperature": 0,
                             "ids": ids, "bytes": [list(vocab[i]) for i in ids],
                             "content": content, "completion_tokens": total,
                             "stop_type": truth.get("stop_type")})  # fmt: skip
            print(f"{name}: {len(ids)} tokens")
    finally:
        proc.terminate()
        proc.wait(10)
    (args.out / "MANIFEST.json").write_text(
        json.dumps({"server": "llama-server 0.5.0-dev (llama-cpp-python 0.3.36 sdist)",
                    "model": args.gguf.name, "recordings": manifest},
                   indent=1, ensure_ascii=False) + "\n", "utf-8")  # fmt: skip


if __name__ == "__main__":
    main()
