"""How often JSON's leading whitespace (`constrain.spec.LEADING_WHITESPACE`) changes a
greedy constrained reply: each prompt x schema is generated greedily twice, under
llguidance's compact JSON grammar (`grammar_from_json_schema`, no whitespace at all)
and under the constraint as `constraint_from` builds it now (up to 2 blanks first).
Counted: replies whose first token differs, replies that differ anywhere, replies that
start with whitespace, and replies that validate with `jsonschema` (both variants).

    python benchmarks/constrain_lead.py --models demo smollm2 \\
        --output benchmarks/results/constrain_lead.md
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import llguidance as llg

import tokentrail
from tokentrail.constrain import constraint_from
from tokentrail.engines import engine_for
from tokentrail.sampling import make_params

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "flags": {"type": "object", "properties": {"ok": {"type": "boolean"},
              "mood": {"enum": ["calm", "busy"]}}, "required": ["ok", "mood"]},
    "list": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
}  # fmt: skip
PROMPTS = [
    "Reply in JSON.",
    "Give me a JSON object describing a person.",
    "Answer with JSON only: is the sky blue?",
    "What is the capital of France? Reply as JSON.",
    "List three fruits.",
    "Tell me about Paris.",
    "Return the JSON object and nothing else.",
    "```json",
]


def _ids(tok: Any, prompt: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                  add_generation_prompt=True)  # fmt: skip
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def _run(engine: Any, eos: set[int], ids: list[int], c: Any, n: int) -> list[int]:
    out = []
    for step in engine.generate(ids, make_params(temp=0.0, constraint=c), n):
        if step.token in eos:
            break
        out.append(step.token)
    return out


def _valid(text: str, schema: Any) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def measure(name: str, engine: Any, tok: Any, n: int) -> tuple[str, list[str]]:
    eos = {tok.eos_token_id, *(getattr(tok, "all_special_ids", None) or ())}
    runs = first = anywhere = lead = ok_old = ok_new = 0
    notes = []
    for key, schema in SCHEMAS.items():
        new = constraint_from(json_schema=schema).bind(tok)
        compact = llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "lenient": False}
        )
        old = replace(new, grammar=compact)
        for prompt in PROMPTS:
            ids = _ids(tok, prompt)
            a, b = _run(engine, eos, ids, old, n), _run(engine, eos, ids, new, n)
            ta, tb = tok.decode(a), tok.decode(b)
            runs += 1
            first += a[:1] != b[:1]
            anywhere += a != b
            lead += tb[:1].isspace()
            ok_old += _valid(ta, schema)
            ok_new += _valid(tb, schema)
            if a[:1] != b[:1]:
                notes.append(f"- {name}, {key}, {prompt!r}: {ta[:24]!r} -> {tb[:24]!r}")
    row = (f"| {name} | {runs} | {first} ({first / runs:.0%}) | {anywhere} "
           f"({anywhere / runs:.0%}) | {lead} | {ok_old} | {ok_new} |")  # fmt: skip
    return row, notes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["demo", "smollm2"])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    rows, notes = [], []
    for m in args.models:
        if m == "demo":
            model, tok = tokentrail.load()
            engine = engine_for(model)
            label = "demo model (MLX)"
        else:
            engine, tok = tokentrail.load("smollm2", engine="llamacpp", n_ctx=1024)
            label = "SmolLM2 Q4_1 (llama.cpp)"
        row, more = measure(label, engine, tok, args.max_tokens)
        rows.append(row)
        notes += more
        print(row, flush=True)
    text = "\n".join([
        "# JSON constraints: what leading whitespace changes in greedy replies",
        "",
        "Command: `python benchmarks/constrain_lead.py --models "
        + " ".join(args.models) + f" --max-tokens {args.max_tokens}`",
        "",
        f"{len(SCHEMAS)} schemas x {len(PROMPTS)} chat prompts, greedy, at most "
        f"{args.max_tokens} tokens; compact = llguidance's JSON grammar with no whitespace "
        "(before), lead = up to 2 blanks before the value (now).",
        "",
        "| model | replies | first token changed | any token changed | lead starts with "
        "whitespace | valid (compact) | valid (lead) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Replies whose first token changed:",
        "",
        *(notes or ["- none"]),
        "",
    ])  # fmt: skip
    if args.output:
        args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
