"""Talking to the server: the probes sent over HTTP (httpx), their answers recorded.

`Checker.run` sends every probe of `tokentrail.check.prompts`, records what came back
and hands it to the pure checks (`tokentrail.check.contract`) and to the realigner;
the result is a `tokentrail.check.report.Report`. An unreachable server raises
`tokentrail.errors.UpstreamError` (the CLI's exit 2).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from ..engines.upstream.dialects import DIALECTS, UpstreamDialect, model_owners, pick_dialect
from ..errors import UpstreamError
from ..realign.dialects import parse_chunk
from ..realign.result import RealignError
from . import contract, prompts
from .capabilities import capabilities
from .contract import Answer, Finding, Stream
from .prompts import Probe
from .report import Report

log = logging.getLogger("tokentrail.check")


def proxy_dialect(models: Any, server_header: str) -> str:
    """The name of the dialect `serve --upstream` would pick (``auto``) from /v1/models
    and the Server header: the proxy's own choice
    (`tokentrail.engines.upstream.dialects.pick_dialect`)."""
    return pick_dialect(models, server_header).name


def _sse(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            out.append(json.loads(data))
        except ValueError:
            out.append({"error": {"message": f"not JSON: {data[:60]}"}})
    return out


class Checker:
    """Checks the OpenAI-compatible server at `url` (see the module docstring).

    `model` defaults to the first of /v1/models; `tokenizer` (anything `load_vocab`
    reads), when given, realigns every stream too; `quick` runs `prompts.QUICK` only.
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        tokenizer: Any = None,
        timeout: float = 120.0,
        quick: bool = False,
    ) -> None:
        import httpx

        url = url.rstrip("/")
        self.url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No kept-alive connections: llama-server was seen to drop a request sent on a
        # connection that had just carried a stream.
        limits = httpx.Limits(max_keepalive_connections=0)
        self.client = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits)
        self.model = model
        self.tokenizer = tokenizer
        self.quick = quick
        self.chat = True
        self.report = Report(url=self.url, quick=quick)
        #: The dialect the proxy would speak to this server (set by discovery): what the
        #: probes ask for beyond OpenAI's fields, as the proxy asks.
        self.dialect: UpstreamDialect = DIALECTS[self.report.dialect]
        self.streams: dict[str, tuple[Stream, list[Any]]] = {}

    # -- HTTP --

    def send(self, method: str, path: str, body: Any = None) -> Answer:
        import httpx

        try:
            r = self.client.request(method, self.url + path, json=body, headers=self.headers)
        except httpx.TimeoutException as e:
            return Answer(504, text=f"timed out: {e}")
        except httpx.HTTPError as e:
            raise UpstreamError(f"cannot reach {self.url}{path}: {e}") from e
        streamed = r.headers.get("content-type", "").startswith("text/event-stream")
        text = r.text
        chunks: list[Any] = []
        if streamed:
            chunks = _sse(text)
        else:
            try:
                chunks = [json.loads(text)]
            except ValueError:
                chunks = []
        return Answer(r.status_code, chunks, text, dict(r.headers))

    def ask(self, probe: Probe, stream: bool = True, **extra: Any) -> Answer:
        """Send `probe` (chat, or completions for a server without chat)."""
        body: dict[str, Any] = {
            "max_tokens": probe.max_tokens,
            **self.dialect.chat_fields(),
            **probe.settings,
            **extra,
        }
        if self.model is not None:
            body["model"] = self.model
        if self.chat:
            body["messages"] = [{"role": "user", "content": probe.prompt}]
            body.setdefault("logprobs", True)
            if body["logprobs"] is True:
                body.setdefault("top_logprobs", 3)
        else:
            body["prompt"] = probe.prompt
            body["logprobs"] = 3 if body.get("logprobs", True) is True else body["logprobs"]
            body.pop("top_logprobs", None)
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return self.send("POST", "/v1/chat/completions" if self.chat else "/v1/completions", body)

    # -- the run --

    def run(self) -> Report:
        """Every probe, then the capabilities; the filled-in `Report`."""
        try:
            self._discover()
            self._streams()
            self._errors()
            if not self.quick:
                self._extras()
            self._capabilities()
            if self.tokenizer is not None:
                self._realign()
        finally:
            self.client.close()
        return self.report

    def _discover(self) -> None:
        a = self.send("GET", "/v1/models")
        rep = self.report
        models = a.chunks[0] if a.ok and a.chunks else {}
        data = models.get("data") if isinstance(models, Mapping) else None
        if self.model is None and isinstance(data, list) and data and isinstance(data[0], Mapping):
            self.model = str(data[0].get("id"))
        rep.model = self.model
        rep.server = a.headers.get("server", "")
        rep.owned_by = sorted(model_owners(models))
        self.dialect = pick_dialect(models, rep.server)
        rep.dialect = self.dialect.name
        if self.dialect.check_note:
            rep.notes.append(self.dialect.check_note)
        first = self.ask(prompts.EOS, stream=False, logprobs=False)
        if not first.ok:
            self.chat = False
            again = self.ask(prompts.EOS, stream=False, logprobs=False)
            if not again.ok:
                raise UpstreamError(
                    f"{self.url} answers neither /v1/chat/completions ({first.status}) nor "
                    f"/v1/completions ({again.status}): {again.text[:200]}"
                )
            rep.notes.append(f"/v1/chat/completions answered {first.status}: probed "
                             "/v1/completions instead")  # fmt: skip
        rep.endpoint = "/v1/chat/completions" if self.chat else "/v1/completions"

    def _record(self, name: str, answer: Answer) -> Stream:
        s = contract.read_stream(answer.chunks)
        if not answer.ok:
            s.error = s.error or f"{answer.status}: {answer.text[:120]}"
        if s.error:
            self.report.notes.append(f"{name}: the server answered an error: {s.error}")
        self.streams[name] = (s, answer.chunks)
        return s

    def _streams(self) -> None:
        probes = prompts.QUICK if self.quick else prompts.FULL
        add = self.report.findings.extend
        for probe in probes:
            if probe.name == "stop":
                self._stop(probe)
                continue
            if probe.name == "long":
                self._long(probe)
                continue
            if probe.name == "n":
                self._choices(probe)
                continue
            s = self._record(probe.name, self.ask(probe))
            if s.error:
                continue
            add(contract.check_join(probe.name, s))
            add([contract.check_usage(probe.name, [s])])
            if probe.name == "eos" and s.finish_reason != "stop":
                self.report.notes.append(f"eos: the model did not end by itself "
                                         f"(finish_reason {s.finish_reason!r})")  # fmt: skip

    def _stop(self, probe: Probe) -> None:
        base = self._record("stop baseline", self.ask(probe))
        if base.error:
            return
        self.report.findings.extend(contract.check_join("stop baseline", base))
        if not base.entries:  # no streamed logprobs: a whole response may have them
            whole = self.ask(probe, stream=False)
            base = contract.read_whole(whole.chunks[0] if whole.ok and whole.chunks else {})
        plan = contract.plan_stop(base)
        if plan is None:
            why = "no stop string could be chosen (the baseline's tokens do not suit)"
            self.report.findings.append(Finding("stop_tokens", probe.name, contract.SKIP, why))
            return
        s = self._record(probe.name, self.ask(probe, stop=[plan.stop]))
        self.report.stop = plan.stop
        if not s.error:
            self.report.stop_honoured = s.content == plan.content
            self.report.findings.extend(contract.check_stop(probe.name, plan, s))

    def _long(self, probe: Probe) -> None:
        s = self._record(probe.name, self.ask(probe))
        if s.error:
            return
        add = self.report.findings.extend
        add(contract.check_join(probe.name, s))
        add([contract.check_usage(probe.name, [s])])
        whole = [contract.read_whole(a.chunks[0]) if a.ok and a.chunks else None
                 for a in (self.ask(probe, stream=False) for _ in range(2))]  # fmt: skip
        if whole[0] is None or whole[1] is None:
            add([Finding("stream_whole", probe.name, contract.SKIP, "the whole request failed")])
            return
        if whole[0].entries and not s.entries:
            self.report.notes.append(
                f"whole responses list logprobs ({len(whole[0].entries)} entries"
                + (", with ids" if all(e.id is not None for e in whole[0].entries) else "")
                + (", with bytes" if all(e.raw is not None for e in whole[0].entries) else "")
                + "), streams do not"
            )
        self.report.seed_reproducible = whole[0].content == whole[1].content
        if not self.report.seed_reproducible:
            why = "two whole responses with the same seed differ: the seed is not honoured"
            add([Finding("stream_whole", probe.name, contract.SKIP, why)])
            return
        add([contract.check_agree(probe.name, s, whole[0])])

    def _choices(self, probe: Probe) -> None:
        a = self.ask(probe)
        if not a.ok:
            self.report.choices = 0
            return
        got = contract.choices_in(a.chunks)
        self.report.choices = len(got)
        streams = [contract.read_stream(a.chunks, c) for c in sorted(got)]
        for c, s in zip(sorted(got), streams, strict=True):
            self.report.findings.extend(contract.check_join(f"n (choice {c})", s))
        self.report.findings.append(contract.check_usage(probe.name, streams))
        if streams:
            self.streams[probe.name] = (streams[0], a.chunks)

    def _errors(self) -> None:
        for name, body in prompts.BAD_REQUESTS:
            if not self.chat:
                body = {"prompt": 5, "max_tokens": -5}
            body = {**body, "model": self.model} if self.model else body
            path = "/v1/chat/completions" if self.chat else "/v1/completions"
            a = self.send("POST", path, body)
            self.report.findings.append(contract.check_error(name, a.status, a.text))

    def _extras(self) -> None:
        """Capability probes: tools, response_format, ids, prompt logprobs (short)."""
        short = Probe("extra", "", "Hi", 8, {"temperature": 0})
        rep = self.report
        rep.extra["tools"] = self.ask(short, stream=True, logprobs=False,
                                      tools=[prompts.TOOL], tool_choice="auto")  # fmt: skip
        rep.extra["response_format"] = self.ask(
            short, stream=False, logprobs=False, response_format={"type": "json_object"}
        )
        rep.extra["return_token_ids"] = self.ask(short, stream=True, return_token_ids=True)
        comp = {"prompt": "Hello world", "max_tokens": 1, "logprobs": 1}
        if self.model:
            comp["model"] = self.model
        rep.extra["echo"] = self.send("POST", "/v1/completions", {**comp, "echo": True})
        rep.extra["prompt_logprobs"] = self.send("POST", "/v1/completions",
                                                 {**comp, "prompt_logprobs": 1})  # fmt: skip
        native = {"prompt": "Hi", "n_predict": 2, "n_probs": 2}
        rep.extra["llamacpp"] = self.send("POST", "/completion", native)

    def _capabilities(self) -> None:
        streams = {k: v[0] for k, v in self.streams.items()}
        sources = set()
        for _, chunks in self.streams.values():
            sources |= wire_sources(chunks)
        self.report.sources = sorted(sources)
        self.report.capabilities = capabilities(self.report, streams)

    def _realign(self) -> None:
        from ..realign.core import realign
        from ..vocab import load_vocab

        vocab = load_vocab(self.tokenizer)
        for name, (_, chunks) in self.streams.items():
            try:
                r = realign(chunks, vocab)
            except RealignError as e:
                self.report.realign[name] = {"exact": False, "summary": str(e)}
                continue
            self.report.realign[name] = {
                "exact": r.exact,
                "source": r.source,
                "refused": len(r.refused),
                "unknown_index": sum(1 for x in r.refused if x.index is None),
                "summary": r.summary(),
            }


def wire_sources(chunks: list[Any]) -> set[str]:
    """How the chunks identify their tokens, as the realigner reads them (its
    `RealignResult.source` names), without a tokenizer."""
    out: set[str] = set()
    for chunk in chunks:
        try:
            frame = parse_chunk(chunk)
        except RealignError:
            continue
        if frame is None:
            continue
        if frame.ext is not None:
            out.add("tokentrail-extension")
        out.update(w.source for w in frame.tokens if w.source)
    return out
