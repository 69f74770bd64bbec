"""The vLLM metrics contract: the Prometheus series an engine exports and what the router reads.

One module spells it, and every side uses it:

- the router's scraper (``scrape.py``) parses a ``/metrics`` page into
  ``VllmMetrics`` with ``parse_vllm_page``;
- the engine registry (``engines.py``) and the cluster simulator
  (``misat_sim.cluster``) turn ``VllmMetrics`` into the policy's
  ``EngineSnapshot`` the same way (``EngineSnapshot.from_metrics``);
- the simulator's exporter (``misat_sim.metrics``) serves these names, types,
  help texts, labels and buckets;
- the fidelity harness (``misat_bench.fidelity``) reads a real server by them.

Names, types and labels follow vLLM V1 (``vllm/v1/metrics/loggers.py``; see
docs/real-vllm.md): every series has the labels ``engine`` (the engine index,
as a string) and ``model_name``, except ``vllm:cache_config_info`` whose labels
are the cache config fields plus ``engine``. Counters are registered without
the ``_total`` suffix that the text exposition adds to their samples.

Adding an engine metric the policy uses: a ``VllmMetric`` here, a field in
``VllmMetrics`` (which ``EngineSnapshot`` inherits), a branch in
``parse_vllm_page``, and the value in ``misat_sim.metrics.read_metrics``;
``tests/sim/test_metrics_contract.py`` checks that the exporter and the parser agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "vllm:"
"""Every vLLM series starts with this; a page without one is not a vLLM engine's."""

ENGINE_LABEL = "engine"
MODEL_LABEL = "model_name"
FINISHED_REASON_LABEL = "finished_reason"
NUM_GPU_BLOCKS_LABEL = "num_gpu_blocks"
BLOCK_SIZE_LABEL = "block_size"


class MetricKind(StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class VllmMetric:
    """One vLLM series: its registered name, type and help text, and the sample names read."""

    name: str
    """The family name vLLM registers (counters without ``_total``)."""
    kind: MetricKind
    help: str
    legacy_samples: tuple[str, ...] = ()
    """Sample names of the same series in older vLLM releases, also accepted by the parser."""

    @property
    def sample(self) -> str:
        """The sample name in today's text exposition (counters gain ``_total``)."""
        return self.name + "_total" if self.kind is MetricKind.COUNTER else self.name

    @property
    def samples(self) -> frozenset[str]:
        """Every sample name the router reads as this series."""
        return frozenset((self.sample, *self.legacy_samples))


NUM_REQUESTS_RUNNING = VllmMetric(
    "vllm:num_requests_running", MetricKind.GAUGE, "Number of requests in model execution batches."
)
NUM_REQUESTS_WAITING = VllmMetric(
    "vllm:num_requests_waiting", MetricKind.GAUGE, "Number of requests waiting to be processed."
)
KV_CACHE_USAGE = VllmMetric(
    "vllm:kv_cache_usage_perc", MetricKind.GAUGE, "KV-cache usage. 1 means 100 percent usage.",
    legacy_samples=("vllm:gpu_cache_usage_perc",),  # before vLLM 0.10
)
NUM_PREEMPTIONS = VllmMetric(
    "vllm:num_preemptions", MetricKind.COUNTER, "Cumulative number of preemption from the engine."
)
PREFIX_CACHE_QUERIES = VllmMetric(
    "vllm:prefix_cache_queries", MetricKind.COUNTER,
    "Prefix cache queries, in terms of number of queried tokens.",
    legacy_samples=("vllm:gpu_prefix_cache_queries_total",),
)
PREFIX_CACHE_HITS = VllmMetric(
    "vllm:prefix_cache_hits", MetricKind.COUNTER, "Prefix cache hits, in terms of number of cached tokens.",
    legacy_samples=("vllm:gpu_prefix_cache_hits_total",),
)
PROMPT_TOKENS = VllmMetric("vllm:prompt_tokens", MetricKind.COUNTER, "Number of prefill tokens processed.")
GENERATION_TOKENS = VllmMetric(
    "vllm:generation_tokens", MetricKind.COUNTER, "Number of generation tokens processed."
)
REQUEST_SUCCESS = VllmMetric(
    "vllm:request_success", MetricKind.COUNTER, "Count of successfully processed requests."
)
"""Labelled by ``finished_reason`` besides ``engine`` and ``model_name``."""
CACHE_CONFIG_INFO = VllmMetric(
    "vllm:cache_config_info", MetricKind.GAUGE, "Information of the LLMEngine CacheConfig",
    # An exporter that declares it as an ``info`` family writes this sample name.
    legacy_samples=("vllm:cache_config_info_info",),
)
"""Value 1; the cache config is in the labels (``num_gpu_blocks``, ``block_size``, ...)."""

TIME_TO_FIRST_TOKEN = VllmMetric(
    "vllm:time_to_first_token_seconds", MetricKind.HISTOGRAM, "Histogram of time to first token in seconds."
)
E2E_REQUEST_LATENCY = VllmMetric(
    "vllm:e2e_request_latency_seconds", MetricKind.HISTOGRAM, "Histogram of e2e request latency in seconds."
)
REQUEST_QUEUE_TIME = VllmMetric(
    "vllm:request_queue_time_seconds", MetricKind.HISTOGRAM,
    "Histogram of time spent in WAITING phase for request.",
)
REQUEST_PREFILL_TIME = VllmMetric(
    "vllm:request_prefill_time_seconds", MetricKind.HISTOGRAM,
    "Histogram of time spent in PREFILL phase for request.",
)
REQUEST_DECODE_TIME = VllmMetric(
    "vllm:request_decode_time_seconds", MetricKind.HISTOGRAM,
    "Histogram of time spent in DECODE phase for request.",
)
INTER_TOKEN_LATENCY = VllmMetric(
    "vllm:inter_token_latency_seconds", MetricKind.HISTOGRAM, "Histogram of inter-token latency in seconds."
)

TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""vLLM's buckets for ``vllm:time_to_first_token_seconds``."""

REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""vLLM's buckets for the e2e latency and the request phase histograms."""


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    """What the router reads from one engine's ``/metrics``.

    Counters (``*_total``) are cumulative, as vLLM exports them; consumers
    difference consecutive readings. ``kv_capacity_tokens`` is
    ``num_gpu_blocks * block_size`` from ``vllm:cache_config_info``.
    """

    kv_capacity_tokens: int = 0
    kv_usage: float = 0.0
    """``vllm:kv_cache_usage_perc`` (0..1)."""
    num_running: int = 0
    num_waiting: int = 0
    prefix_queries_total: float = 0.0
    prefix_hits_total: float = 0.0
    preemptions_total: float = 0.0

    def without_load(self) -> VllmMetrics:
        """The static and cumulative values only: load gauges read 0 (unknown)."""
        return replace(self, kv_usage=0.0, num_running=0, num_waiting=0)


def _int_label(labels: dict[str, str], key: str) -> int:
    try:
        value = float(labels.get(key, "0"))
    except ValueError:  # vLLM writes "None" for unset values
        return 0
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"label {key}={labels.get(key)!r} is not a count")
    return int(value)


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Parse a Prometheus text page; unknown metrics are ignored, missing ones read as 0.

    Raises ``ValueError`` when the page is not Prometheus text or a vLLM value
    is not a finite, non-negative number.
    """
    return parse_vllm_page(text)[0]


def parse_vllm_page(text: str) -> tuple[VllmMetrics, bool]:
    """``parse_vllm_metrics`` plus whether the page held any vLLM metric at all.

    A page without one (empty, another exporter's) tells the router nothing,
    so a scrape treats it as failed rather than as an idle, empty engine.
    A server with several internal engines (label ``engine``) is summed:
    counts and counters add up, KV usage is the capacity-weighted mean, KV
    capacity is the sum over each engine's ``vllm:cache_config_info``.
    """
    seen = False
    usage: dict[str, float] = {}
    capacity: dict[str, int] = {}
    running = waiting = 0.0
    queries = hits = preemptions = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(PREFIX):
                continue
            seen = True
            if not math.isfinite(s.value) or s.value < 0:
                raise ValueError(f"{s.name} has the value {s.value}")
            engine = s.labels.get(ENGINE_LABEL, "")
            if s.name in KV_CACHE_USAGE.samples:
                usage[engine] = s.value
            elif s.name in NUM_REQUESTS_RUNNING.samples:
                running += s.value
            elif s.name in NUM_REQUESTS_WAITING.samples:
                waiting += s.value
            elif s.name in PREFIX_CACHE_QUERIES.samples:
                queries += s.value
            elif s.name in PREFIX_CACHE_HITS.samples:
                hits += s.value
            elif s.name in NUM_PREEMPTIONS.samples:
                preemptions += s.value
            elif s.name in CACHE_CONFIG_INFO.samples:
                blocks = _int_label(s.labels, NUM_GPU_BLOCKS_LABEL)
                capacity[engine] = blocks * _int_label(s.labels, BLOCK_SIZE_LABEL)
    total_cap = sum(capacity.values())
    if total_cap > 0 and set(usage) <= set(capacity):
        kv_usage = sum(u * capacity.get(e, 0) for e, u in usage.items()) / total_cap
    else:
        kv_usage = sum(usage.values()) / len(usage) if usage else 0.0
    metrics = VllmMetrics(
        kv_capacity_tokens=total_cap,
        kv_usage=kv_usage,
        num_running=round(running),
        num_waiting=round(waiting),
        prefix_queries_total=queries,
        prefix_hits_total=hits,
        preemptions_total=preemptions,
    )
    return metrics, seen
