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
import re
from dataclasses import dataclass, replace
from enum import Enum, StrEnum, auto

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

    Raises ``ValueError`` when a series the router reads is malformed or its
    value is not a finite, non-negative number.
    """
    return parse_vllm_page(text)[0]


class _Read(Enum):
    """Which ``VllmMetrics`` input a sample feeds."""

    KV_USAGE = auto()
    RUNNING = auto()
    WAITING = auto()
    QUERIES = auto()
    HITS = auto()
    PREEMPTIONS = auto()
    CACHE_CONFIG = auto()


_READ_SAMPLES: dict[str, _Read] = {
    name: read
    for metric, read in (
        (KV_CACHE_USAGE, _Read.KV_USAGE),
        (NUM_REQUESTS_RUNNING, _Read.RUNNING),
        (NUM_REQUESTS_WAITING, _Read.WAITING),
        (PREFIX_CACHE_QUERIES, _Read.QUERIES),
        (PREFIX_CACHE_HITS, _Read.HITS),
        (NUM_PREEMPTIONS, _Read.PREEMPTIONS),
        (CACHE_CONFIG_INFO, _Read.CACHE_CONFIG),
    )
    for name in metric.samples
}
"""Every sample name the router reads, and what it feeds."""

# The text exposition format (0.0.4), as far as the read lines need it. Quoted label
# values take backslash escapes; the patterns are "unrolled" ([^"\\]* runs, then one
# escape) so the regex engine moves through a value in runs, not a character at a time.
_QUOTED = r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"'
_LABEL = rf"[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*({_QUOTED})[ \t]*"
_LABELS = re.compile(rf"(?:{_LABEL},)*(?:{_LABEL})?[ \t]*")
"""A whole label set: pairs separated by commas, a trailing comma allowed."""
_LABEL_PAIR = re.compile(_LABEL)
_READ_NAMES = "|".join(re.escape(n) for n in sorted(_READ_SAMPLES, key=len, reverse=True))
_READ_LINE = re.compile(
    rf"\n[ \t]*({_READ_NAMES})(?:[ \t]*\{{((?:[^\"}}\n]|{_QUOTED})*)\}}[ \t]*|[ \t]+)"
    r"([^ \t\r\n]+)(?:[ \t]+([^ \t\r\n]+))?[ \t\r]*(?=\n)"
    rf"|\n[ \t]*({_READ_NAMES})(?=[ \t{{\r\n])[^\n]*"
)
"""A line of a series read here (name, labels, value, timestamp) on a page framed by newlines;
or, in the last group, one that starts like it but does not parse."""
_VLLM_LINE = re.compile(r"\n[ \t]*" + re.escape(PREFIX))
"""A sample line of any vLLM series."""
_ESCAPE = re.compile(r"\\(.)")
_UNESCAPED = {"\\": "\\", "n": "\n", '"': '"'}


def _unescape(quoted: str) -> str:
    """A label value as written (in quotes, with ``\\\\``, ``\\"`` and ``\\n`` escapes) as a string."""
    value = quoted[1:-1]
    return _ESCAPE.sub(lambda m: _UNESCAPED.get(m.group(1), m.group(0)), value) if "\\" in value else value


def _labels(text: str, line: str) -> dict[str, str]:
    # Checked whole, then read pair by pair: two passes in C, no loop over labels here
    # (vllm:cache_config_info carries about forty).
    if _LABELS.fullmatch(text) is None:
        raise ValueError(f"malformed labels in {line[:200]!r}")
    return {k: _unescape(v) for k, v in _LABEL_PAIR.findall(text)}


def _number(text: str, line: str) -> float:
    """A sample value as the exposition format writes it (``1``, ``0.5``, ``1e3``, ``+Inf``, ``NaN``)."""
    if "_" in text:  # float() would read 1_000; the format does not
        raise ValueError(f"invalid value {text!r} in {line[:200]!r}")
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"invalid value {text!r} in {line[:200]!r}") from None


def parse_vllm_page(text: str) -> tuple[VllmMetrics, bool]:
    """``parse_vllm_metrics`` plus whether the page held any vLLM metric at all.

    A page without one (empty, another exporter's) tells the router nothing,
    so a scrape treats it as failed rather than as an idle, empty engine.
    A server with several internal engines (label ``engine``) is summed:
    counts and counters add up, KV usage is the capacity-weighted mean, KV
    capacity is the sum over each engine's ``vllm:cache_config_info``.

    Only the lines of the series read here are parsed and checked: a real
    vLLM page holds about 600 lines (histogram buckets, process metrics) and a
    full parse of it took about 8 ms of the router's one event loop, four
    times a second per engine (docs/scale.md, "Watching many engines"). So a
    malformed or non-finite line of a series the router does not read does
    not fail the scrape. Counters are read by their ``_total`` sample names,
    as every Prometheus client library writes them.
    """
    usage: dict[str, float] = {}
    capacity: dict[str, int] = {}
    running = waiting = 0.0
    queries = hits = preemptions = 0.0
    page = "\n" + text + "\n"  # every line, the first and the last too, between two newlines
    seen = _VLLM_LINE.search(page) is not None
    for m in _READ_LINE.finditer(page):
        name, label_text, value_text, timestamp, unparsed = m.groups()
        if unparsed is not None:
            raise ValueError(f"malformed sample {m.group(0).strip()[:200]!r}")
        line = m.group(0)
        if timestamp is not None:
            _number(timestamp, line)
        value = _number(value_text, line)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} has the value {value}")
        labels = _labels(label_text, line) if label_text else {}
        engine = labels.get(ENGINE_LABEL, "")
        read = _READ_SAMPLES[name]
        if read is _Read.KV_USAGE:
            usage[engine] = value
        elif read is _Read.RUNNING:
            running += value
        elif read is _Read.WAITING:
            waiting += value
        elif read is _Read.QUERIES:
            queries += value
        elif read is _Read.HITS:
            hits += value
        elif read is _Read.PREEMPTIONS:
            preemptions += value
        else:
            blocks = _int_label(labels, NUM_GPU_BLOCKS_LABEL)
            capacity[engine] = blocks * _int_label(labels, BLOCK_SIZE_LABEL)
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
