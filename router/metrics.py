"""Prometheus ``/metrics`` for the router: ``misat_*`` names in a per-app registry.

Two kinds of series:

- event series, updated where the event happens (decisions, held requests,
  outcomes, hold waits, proxy overhead, retries, tokens);
- state gauges, computed at scrape time from the same ``RouterStatus``
  snapshot ``/status`` serves (held queue, sessions, KV budget and use per
  engine and class, engine health, prefix-hit rate, mixture, sample rate).

A per-app ``CollectorRegistry`` keeps two apps in one process (tests) apart.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .policy.types import Completion, Decision
from .status import RouterStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

HOLD_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
"""Seconds; holds last from one epoch (0.5 s) to the hold deadline (300 s by default)."""
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
"""Seconds; the router's own work per request should be well under a millisecond."""


class Outcome:
    """Labels of ``misat_requests_total{outcome}``."""

    OK = "ok"
    ENGINE_ERROR = "engine_error"
    """The engine answered with a 4xx/5xx status (passed through)."""
    UPSTREAM_FAILED = "upstream_failed"
    """The engine took the request and then failed it: a read timeout, or a stream broken mid-way
    (an attempt that failed before any byte reached the client counts as ``retried`` instead)."""
    RETRIED = "retried"
    """An attempt that failed before any byte reached the client; placed again."""
    CLIENT_DISCONNECT = "client_disconnect"
    HOLD_DEADLINE = "hold_deadline"
    """Still held after ``hold_deadline_s``: capacity (503 ``hold_deadline_exceeded``)."""
    NO_HEALTHY_ENGINE = "no_healthy_engine"
    """No engine in rotation for ``no_healthy_engine_wait_s``: engines down (503 ``no_healthy_engine``)."""
    SHUTDOWN = "shutdown"
    ABORTED = "aborted"
    """Aborted by the router for ``/admin/pause?mode=abort`` (the engine could not abort it)."""


class _StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], RouterStatus]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        g = GaugeMetricFamily
        held = g("misat_held_requests", "Requests waiting in the HOLD ledger.", labels=["class"])
        active = g("misat_active_sessions", "Live sessions.", labels=["class"])
        target = g("misat_mixture_target", "Target share of completed units.", labels=["class"])
        consumed = g("misat_mixture_consumed", "Consumed share of completed units.", labels=["class"])
        units = CounterMetricFamily(
            "misat_completed_units", "Completed rollout units (an agentic trajectory is one).",
            labels=["class"],
        )
        for c in s.classes:
            held.add_metric([c.name], c.held_requests)
            active.add_metric([c.name], c.active_sessions)
            target.add_metric([c.name], c.target_share)
            consumed.add_metric([c.name], c.consumed_share)
            units.add_metric([c.name], c.completed_units)
        yield from (held, active, target, consumed, units)

        budget = g("misat_kv_budget_tokens", "Class KV budget M_{w,b}.", labels=["engine", "class"])
        used = g("misat_kv_used_tokens", "Class KV in use (sessions x k_b).", labels=["engine", "class"])
        cap = g("misat_class_session_cap", "Class session cap K_{w,b}.", labels=["engine", "class"])
        for r in s.kv:
            if r.budget_tokens is not None:
                budget.add_metric([r.engine, r.workload_class], r.budget_tokens)
            if r.used_tokens is not None:
                used.add_metric([r.engine, r.workload_class], r.used_tokens)
            if r.cap is not None:
                cap.add_metric([r.engine, r.workload_class], r.cap)
        yield from (budget, used, cap)

        version = g("misat_engine_weight_version_info", "1 for the weight version recorded for the engine.",
                    labels=["engine", "version"])
        for e in s.engines:
            if e.weight_version is not None:
                version.add_metric([e.id, e.weight_version], 1.0)
        yield version

        healthy = g("misat_engine_healthy", "1 when the engine passes its health checks (in rotation unless held).",
                    labels=["engine"])
        held = g("misat_engine_held", "1 when the engine, though healthy, is held with its start-up weights "
                 "(it restarted, or joined the pool, after a weight version was recorded).", labels=["engine"])
        inflight = g("misat_engine_in_flight", "Router requests in flight.", labels=["engine"])
        kv_usage = g("misat_engine_kv_usage", "vLLM KV usage (0..1).", labels=["engine"])
        hit = g("misat_engine_prefix_hit_rate", "Engine prefix-hit rate.", labels=["engine"])
        for e in s.engines:
            healthy.add_metric([e.id], 1.0 if e.healthy else 0.0)
            held.add_metric([e.id], 1.0 if e.held is not None else 0.0)
            inflight.add_metric([e.id], e.in_flight)
            kv_usage.add_metric([e.id], e.kv_usage)
            if e.prefix_hit_rate is not None:
                hit.add_metric([e.id], e.prefix_hit_rate)
        yield from (healthy, held, inflight, kv_usage, hit)

        yield g("misat_prefix_hit_rate", "Prefix-hit rate over all engines.",
                value=s.prefix_hit_rate if s.prefix_hit_rate is not None else 0.0)
        yield g("misat_mixture_tv_points", "TV distance target vs consumed (points).",
                value=s.mixture_tv_points)
        yield g("misat_sample_rate_per_min", "Completed units per minute (window).",
                value=s.sample_rate_per_min)
        yield g("misat_requests_in_flight", "Requests in flight.", value=s.requests_in_flight)
        yield g("misat_config_generation", "Applied config generation.", value=s.generation)
        yield g("misat_paused", "1 while paused.", value=1.0 if s.paused else 0.0)


class _PerRequestSeries(Collector):
    """The series every request updates, kept as plain numbers and turned into metric families at scrape
    time: decisions, outcomes, tokens, and the proxy-overhead histogram.

    prometheus_client's metric objects take a lock and check label values on every update, and the
    data plane updates five of these series per request; the router runs one thread, so plain
    dictionaries are enough, and the exposition is the same (names, labels, buckets).
    """

    def __init__(self) -> None:
        self.decisions: dict[tuple[str, str, str], float] = {}
        self.requests: dict[tuple[str, str], float] = {}
        self.tokens: dict[tuple[str, str], float] = {}
        self.overhead_counts = [0] * (len(OVERHEAD_BUCKETS) + 1)
        self.overhead_sum = 0.0

    def observe_overhead(self, seconds: float) -> None:
        self.overhead_counts[bisect.bisect_left(OVERHEAD_BUCKETS, seconds)] += 1
        self.overhead_sum += seconds

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily("misat_decisions", "Policy decisions.", labels=["class", "action", "reason"])
        for d_key, v in self.decisions.items():
            decisions.add_metric(list(d_key), v)
        requests = CounterMetricFamily("misat_requests", "Requests by final outcome.", labels=["class", "outcome"])
        for r_key, v in self.requests.items():
            requests.add_metric(list(r_key), v)
        tokens = CounterMetricFamily("misat_tokens", "Tokens from usage (or estimates).", labels=["class", "kind"])
        for t_key, v in self.tokens.items():
            tokens.add_metric(list(t_key), v)
        cumulative, buckets = 0, []
        for le, n in zip((*OVERHEAD_BUCKETS, float("inf")), self.overhead_counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(le), cumulative))
        overhead = HistogramMetricFamily(
            "misat_proxy_overhead_seconds", "Request arrival to upstream request sent, hold time excluded.",
            buckets=buckets, sum_value=self.overhead_sum)
        yield from (decisions, requests, tokens, overhead)


class RouterMetrics:
    """Every ``misat_*`` series of one router app."""

    def __init__(self, snapshot: Callable[[], RouterStatus]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.held = Counter(
            "misat_requests_held", "Requests held on arrival.", ["class", "reason"], registry=r
        )
        self.invalid = Counter("misat_invalid_requests", "Requests refused as malformed.", registry=r)
        self.hold_wait = Histogram(
            "misat_hold_wait_seconds", "Time held before placement or give-up.",
            ["class", "outcome"], buckets=HOLD_WAIT_BUCKETS, registry=r,
        )
        self.engine_failures = Counter(
            "misat_engine_connection_failures", "Connection errors while proxying.", ["engine"],
            registry=r,
        )
        self.reloads = Counter("misat_config_reloads", "Config reloads.", ["source", "result"], registry=r)
        self.aborted = Counter(
            "misat_aborted_requests",
            "In-flight requests aborted by /admin/pause?mode=abort, by who answered the client "
            "(engine: vLLM's abort, partial output; router: the engine could not abort it).",
            ["class", "by"], registry=r,
        )
        self.weight_version_changes = Counter(
            "misat_weight_version_changes", "Changes of an engine's recorded weight version.",
            ["engine"], registry=r,
        )
        self.engine_restarts = Counter(
            "misat_engine_restarts", "Engine restarts seen (its cumulative vLLM counters went back).",
            ["engine"], registry=r,
        )
        self.hand_backs = Counter(
            "misat_engine_hand_backs",
            "Engines a router shard handed back to a returning peer, by how the drain of its own "
            "sessions there ended (drained: none left; idle: none with a request within "
            "shards.handback_idle_s).",
            ["outcome"], registry=r,
        )
        r.register(_StateCollector(snapshot))
        self._per_request = per = _PerRequestSeries()
        r.register(per)
        self.overhead = per.observe_overhead
        """Observe the proxy overhead of one request, in seconds (``misat_proxy_overhead_seconds``)."""

    def decision(self, workload_class: str, decision: Decision) -> None:
        d = self._per_request.decisions
        key = (workload_class, decision.action.value, decision.reason.value)
        d[key] = d.get(key, 0.0) + 1.0

    def finished(self, workload_class: str, outcome: str) -> None:
        """A request's final outcome (``misat_requests_total``)."""
        d = self._per_request.requests
        key = (workload_class, outcome)
        d[key] = d.get(key, 0.0) + 1.0

    def used(self, workload_class: str, completion: Completion) -> None:
        """The tokens a finished request used (``misat_tokens_total``)."""
        d = self._per_request.tokens
        for kind, n in (("prompt", completion.prompt_tokens), ("completion", completion.completion_tokens),
                        ("cached", completion.cached_tokens or 0)):
            if n or kind != "cached":
                d[(workload_class, kind)] = d.get((workload_class, kind), 0.0) + n

    def render(self) -> bytes:
        return generate_latest(self.registry)
