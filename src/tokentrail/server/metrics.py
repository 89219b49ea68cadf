"""Prometheus metrics for `/metrics`, kept in a registry of the app's own.

A registry per app (not prometheus_client's global one) lets several apps live in one
process, as tests do. Everything here is safe to call from any thread.

Under ``serve --workers N`` (`tokentrail.server.workers`) each worker process is started
with ``PROMETHEUS_MULTIPROC_DIR`` set to a folder the supervisor made: prometheus_client
then keeps every value in a file of that folder per process, and `exposition` sums them
over the workers (`MultiProcessCollector`); gauges sum the live workers' values. The
registry itself, which `/health` reads, still holds this process's own values.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import Histogram

#: Seconds: first-token latency spans queueing and prompt processing.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: Seconds a request waits for the loop to take it, and a sequence's prompt processing.
_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                 10, 30, 60)
#: Seconds between two tokens of one sequence.
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
#: Seconds compiling one request's constraint (llguidance, on the compile pool).
_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

#: The environment variable prometheus_client's multiprocess mode is switched on by.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: Every outcome a generation request can have.
OUTCOMES = ("completed", "cancelled", "failed", "rejected", "dropped")


class Metrics:
    """The server's counters, gauges and histograms (names start with ``tokentrail_``)."""

    ttft: Histogram
    queue_wait: Histogram
    prefill: Histogram
    itl: Histogram
    compile_time: Histogram

    def __init__(self) -> None:
        # Imported here: `tokentrail serve`'s parser must load without the server extra.
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "tokentrail_http_requests",
            "HTTP requests answered, by route and status code",
            ["path", "status"],
            registry=r,
        )
        self.outcomes = Counter(
            "tokentrail_generations",
            "Generation requests by outcome (completed, cancelled, dropped, failed, rejected)",
            ["outcome"],
            registry=r,
        )
        # "livesum": across worker processes, the sum over the live ones.
        self.queue_depth = Gauge(
            "tokentrail_queue_depth", "Requests waiting for room in the batch", registry=r,
            multiprocess_mode="livesum",
        )
        self.batch_size = Gauge(
            "tokentrail_batch_size", "Sequences in the batch now", registry=r,
            multiprocess_mode="livesum",
        )
        self.generated_tokens = Counter(
            "tokentrail_generated_tokens", "Tokens generated, all sequences", registry=r
        )
        self.prompt_tokens_cached = Counter(
            "tokentrail_prompt_cache_hit_tokens",
            "Prompt tokens reused from the prompt cache",
            registry=r,
        )
        self.prompt_cache_hits = Counter(
            "tokentrail_prompt_cache_hits",
            "Sequences that reused at least one cached prompt token",
            registry=r,
        )
        self.queued_for_room = Counter(
            "tokentrail_queued_for_room",
            "Requests that arrived with the batch full and waited in the queue for room",
            registry=r,
        )
        self.refused_constraints = Counter(
            "tokentrail_constraints_refused",
            "Constraints refused with a 4xx, by reason (invalid: the spec is wrong; "
            "too_complex: over a limit or the compile budget)",
            ["reason"],
            registry=r,
        )
        # Seconds, as histograms: (attribute, name, help, buckets).
        histograms = (
            ("ttft", "tokentrail_time_to_first_token_seconds",
             "Seconds from a request's arrival to its first token", _TTFT_BUCKETS),
            ("queue_wait", "tokentrail_queue_wait_seconds",
             "Seconds from a request's arrival until the generation loop takes it into the "
             "batch (waiting for room when the batch is full, else for the step under way)",
             _WAIT_BUCKETS),
            ("prefill", "tokentrail_prefill_seconds",
             "Seconds from a sequence joining the engine's batch to its first token "
             "(prompt processing, done between the running sequences' steps)", _WAIT_BUCKETS),
            ("itl", "tokentrail_inter_token_latency_seconds",
             "Seconds between consecutive tokens of one sequence", _ITL_BUCKETS),
            ("compile_time", "tokentrail_constraint_compile_seconds",
             "Seconds compiling a request's constraint (JSON schema, regex, choice, grammar "
             "or tool call), off the model's thread", _COMPILE_BUCKETS),
        )
        for attr, name, text, buckets in histograms:
            setattr(self, attr, Histogram(name, text, buckets=buckets, registry=r))

    def request_outcome(self, outcome: str) -> None:
        self.outcomes.labels(outcome=outcome).inc()

    def outcome_counts(self) -> dict[str, int]:
        """Requests so far by outcome (for /health), read from the counters."""
        get = self.registry.get_sample_value
        return {
            o: int(get("tokentrail_generations_total", {"outcome": o}) or 0) for o in OUTCOMES
        }

    def tokens_generated(self) -> int:
        """Tokens generated so far, all sequences (for /health)."""
        return int(self.registry.get_sample_value("tokentrail_generated_tokens_total") or 0)

    def waited_for_room(self) -> int:
        """Requests so far that found the batch full and queued (for /health)."""
        return int(self.registry.get_sample_value("tokentrail_queued_for_room_total") or 0)

    def prompt_cache(self, cached_tokens: int) -> None:
        if cached_tokens > 0:
            self.prompt_cache_hits.inc()
            self.prompt_tokens_cached.inc(cached_tokens)

    def constraint_refused(self, reason: str) -> None:
        """Count a refused constraint ("invalid" or "too_complex")."""
        self.refused_constraints.labels(reason=reason).inc()

    def http(self, path: str, status: int) -> None:
        self.http_requests.labels(path=path, status=str(status)).inc()

    def exposition(self) -> tuple[bytes, str]:
        """Every metric in Prometheus' text format, and that format's media type: this
        process's, or under ``--workers`` every worker's summed."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        shared = os.environ.get(MULTIPROC_ENV)
        if not shared:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        from prometheus_client.multiprocess import MultiProcessCollector

        everyone = CollectorRegistry()
        MultiProcessCollector(everyone, path=shared)
        return generate_latest(everyone), CONTENT_TYPE_LATEST

    def __repr__(self) -> str:
        return f"Metrics({self.registry!r})"
