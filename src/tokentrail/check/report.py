"""What `tokentrail check` found: the `Report`, as a rich table or as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .contract import CHECKS, FAIL, PASS, SKIP, WARN, Answer, Finding

#: Capability statuses, best first.
YES, PARTIAL, NO, NOT_SEEN, UNCHECKED = "yes", "partial", "no", "not seen", "not checked"


@dataclass(frozen=True, slots=True)
class Capability:
    """Whether the server gives one thing (`status`, one of YES..UNCHECKED), and how."""

    name: str
    status: str
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"status": self.status, "detail": self.detail}


#: The capabilities a report lists, in order, with what each means.
CAPABILITIES = {
    "logprobs": "streamed logprobs",
    "bytes": "each entry's raw bytes",
    "top_k": "top_logprobs alternatives",
    "token_ids": "token ids (vLLM return_token_ids, llama.cpp ids / n_probs)",
    "usage_in_stream": "usage in streams (stream_options.include_usage)",
    "prompt_logprobs": "prompt logprobs (echo, or vLLM prompt_logprobs)",
    "reasoning": "reasoning deltas (reasoning_content)",
    "tool_calls": "tool-call deltas",
    "response_format": "response_format json_object",
    "n": "n > 1 choices",
    "seed": "seeded sampling is reproducible",
    "stop": "stop strings",
    "extension": "tokentrail's extension (exact segments)",
}


@dataclass
class Report:
    """The outcome of one check: the server, its capabilities, the contract findings."""

    url: str
    quick: bool = False
    model: str | None = None
    server: str = ""
    owned_by: list[str] = field(default_factory=list)
    #: The dialect `serve --upstream` would use (`--upstream-dialect auto`).
    dialect: str = "openai"
    endpoint: str = "/v1/chat/completions"
    #: How the streams identify tokens, in the realigner's words (`RealignResult.source`).
    sources: list[str] = field(default_factory=list)
    capabilities: dict[str, Capability] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    #: Per probe, what realigning its stream found (with --tokenizer).
    realign: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    stop: str | None = None
    stop_honoured: bool | None = None
    seed_reproducible: bool | None = None
    choices: int | None = None
    #: Answers of the capability probes, by name (not written out).
    extra: dict[str, Answer] = field(default_factory=dict)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.status == FAIL]

    @property
    def ok(self) -> bool:
        """The server keeps its own contract (no check failed)."""
        return not self.failures

    def verdicts(self) -> dict[str, str]:
        """Each check's overall status: fail if any probe failed it, else warn, pass, skip."""
        out = {}
        for name in CHECKS:
            seen = {f.status for f in self.findings if f.check == name}
            out[name] = next((s for s in (FAIL, WARN, PASS) if s in seen), SKIP)
        return out

    def missing(self) -> list[str]:
        """One line per thing the server cannot give (for the proxy's log)."""
        lines = [
            f"{CAPABILITIES[c.name]}: {c.status}" + (f" ({c.detail})" if c.detail else "")
            for c in self.capabilities.values()
            if c.status in (NO, PARTIAL)
        ]
        lines += [f"breaks '{f.check}' on {f.probe}: {f.detail}" for f in self.failures]
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "server": self.server,
            "owned_by": self.owned_by,
            "dialect": self.dialect,
            "endpoint": self.endpoint,
            "sources": self.sources,
            "quick": self.quick,
            "ok": self.ok,
            "capabilities": {k: c.to_dict() for k, c in self.capabilities.items()},
            "contract": self.verdicts(),
            "findings": [f.to_dict() for f in self.findings],
            "realign": self.realign,
            "stop": self.stop,
            "notes": self.notes,
        }


_STYLE = {PASS: "green", FAIL: "bold red", WARN: "yellow", SKIP: "dim", YES: "green",
          PARTIAL: "yellow", NO: "red", NOT_SEEN: "dim", UNCHECKED: "dim"}  # fmt: skip


def render(report: Report, console: Any) -> None:
    """Print `report` as tables on a rich `Console`."""
    from rich.table import Table

    head = f"{report.url}  model {report.model!r}  server {report.server or '?'!r}"
    console.print(head)
    console.print(f"dialect for `serve --upstream`: {report.dialect}; tokens identified by: "
                  f"{', '.join(report.sources) or 'nothing'}")  # fmt: skip
    caps = Table(title="capabilities", title_justify="left")
    for col in ("capability", "status", "detail"):
        caps.add_column(col)
    for name, c in report.capabilities.items():
        caps.add_row(name, f"[{_STYLE.get(c.status, '')}]{c.status}[/]", c.detail)
    console.print(caps)
    table = Table(title="contract", title_justify="left")
    for col in ("check", "status", "probe", "detail"):
        table.add_column(col)
    verdicts = report.verdicts()
    for name in CHECKS:
        found = [f for f in report.findings if f.check == name]
        worst = [f for f in found if f.status == verdicts[name]] or found
        first = worst[0] if worst else Finding(name, "-", SKIP, "not checked")
        style = _STYLE.get(verdicts[name], "")
        table.add_row(name, f"[{style}]{verdicts[name]}[/]", first.probe, first.detail)
    console.print(table)
    for name, r in report.realign.items():
        console.print(f"realign {name}: {r['summary']}")
    for note in report.notes:
        console.print(f"note: {note}")
    verdict = "keeps its contract" if report.ok else "BREAKS its contract"
    console.print(f"{report.url} {verdict}")
