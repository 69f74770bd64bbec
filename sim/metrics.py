"""vLLM's Prometheus metrics for one simulated engine, with vLLM's names and labels.

The router scrapes these exactly as it scrapes a real engine, so names, types
and labels follow vLLM V1 (``vllm/v1/metrics/loggers.py``): every series has
labels ``engine`` (the engine index, as a string) and ``model_name``, except
``vllm:cache_config_info`` whose labels are the cache config fields plus
``engine``, as vLLM exports it.

Gauges and counters are read from the engine at scrape time by a custom
collector (no second copy of the numbers); latency histograms are observed
when requests finish, in *modelled* seconds. Each app gets its own
``CollectorRegistry`` so several engines can live in one process.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from misat_sim.engine import FinishedRequest, SimEngine
from misat_sim.request import FinishReason

TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""vLLM's buckets for ``vllm:time_to_first_token_seconds``."""

REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""vLLM's buckets for e2e latency and queue time histograms."""


class _EngineStateCollector(Collector):
    """Reads gauges and counters off the engine at each scrape."""

    def __init__(self, engine: SimEngine, labels: dict[str, str], cache_labels: dict[str, str]) -> None:
        self._engine = engine
        self._labels = labels
        self._cache_labels = cache_labels

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        c = engine.sync_counters()
        names = list(self._labels)
        values = list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=names)
            m.add_metric(values, value)
            return m

        yield gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", engine.num_running
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine.num_waiting
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.kv_cache_usage()
        )
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", c.num_preemptions
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            c.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            c.prefix_cache_hits,
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", c.generation_tokens)
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        for reason in FinishReason:
            success.add_metric([*values, reason.value], c.request_success.get(reason.value, 0))
        yield success
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(self._cache_labels),
        )
        info.add_metric(list(self._cache_labels.values()), 1.0)
        yield info


class EngineMetrics:
    """The per-engine registry: state collector plus latency histograms."""

    def __init__(self, engine: SimEngine, model_name: str, engine_index: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = {"engine": str(engine_index), "model_name": model_name}
        limits = engine.limits
        cache_labels = {
            "block_size": str(limits.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(limits.enable_prefix_caching),
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(limits.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "engine": str(engine_index),
        }
        self.registry.register(_EngineStateCollector(engine, labels, cache_labels))
        names = list(labels)
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            registry=self.registry,
            buckets=TTFT_BUCKETS,
        ).labels(**labels)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            names,
            registry=self.registry,
            buckets=REQUEST_LATENCY_BUCKETS,
        ).labels(**labels)
        self._queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            names,
            registry=self.registry,
            buckets=REQUEST_LATENCY_BUCKETS,
        ).labels(**labels)

    def observe_finished(self, f: FinishedRequest) -> None:
        """Record a finished request's latencies (modelled seconds)."""
        if f.first_token_time is not None:
            self._ttft.observe(f.first_token_time - f.arrival_time)
        if f.first_scheduled_time is not None:
            self._queue.observe(f.first_scheduled_time - f.arrival_time)
        self._e2e.observe(f.finish_time - f.arrival_time)

    def render(self) -> bytes:
        """Prometheus text exposition of all series."""
        return generate_latest(self.registry)
