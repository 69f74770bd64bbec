"""vLLM's Prometheus metrics for one simulated engine, by the vLLM metrics contract.

The router scrapes these exactly as it scrapes a real engine: names, types,
help texts, labels and buckets come from ``misat_router.vllm_metrics``, the
one place they are spelled; ``read_metrics`` is the same engine as the
router's ``VllmMetrics``.

Gauges and counters are read from the engine at scrape time by a custom
collector (no second copy of the numbers); latency histograms are observed
when requests finish, in *modelled* seconds. Each app gets its own
``CollectorRegistry`` so several engines can live in one process.

One series is the simulator's own, not vLLM's: ``misat_sim_keep_up_ratio``
(label ``window``: ``run`` or ``recent``), the engine loop's keep-up (see
``misat_sim.engine_loop``); it is served once the loop registers its source.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from misat_router import vllm_metrics as vm
from misat_router.vllm_metrics import VllmMetrics
from misat_sim.engine import FinishedRequest, SimEngine
from misat_sim.request import FinishReason


def read_metrics(engine: SimEngine) -> VllmMetrics:
    """The engine as the router reads it from ``/metrics``: what this exporter serves.

    The cluster simulator builds its policy snapshots from this too, so the
    in-process and the HTTP paths see the same numbers.
    """
    c = engine.sync_counters()
    limits = engine.limits
    return VllmMetrics(
        # As the router computes it from vllm:cache_config_info: the reserved null block
        # counts (limits.kv_capacity_tokens leaves it out), so both paths see one number.
        kv_capacity_tokens=limits.num_gpu_blocks * limits.block_size,
        kv_usage=engine.kv_cache_usage(),
        num_running=engine.num_running,
        num_waiting=engine.num_waiting,
        prefix_queries_total=float(c.prefix_cache_queries),
        prefix_hits_total=float(c.prefix_cache_hits),
        preemptions_total=float(c.num_preemptions),
    )


KEEP_UP_METRIC: str = "misat_sim_keep_up_ratio"
KEEP_UP_HELP: str = ("Modelled time the simulated engine advanced while busy / (wall time busy x time scale); "
                     "under 1 it ran slower than modelled (misat simulator, not a vLLM metric)")
KEEP_UP_WINDOW_LABEL: str = "window"

KeepUpSource = Callable[[], dict[str, float | None]]
"""Keep-up figures by window label (None: no busy time yet)."""


class _KeepUpCollector(Collector):
    def __init__(self, source: KeepUpSource, labels: dict[str, str]) -> None:
        self._source = source
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(KEEP_UP_METRIC, KEEP_UP_HELP, labels=[*self._labels, KEEP_UP_WINDOW_LABEL])
        for window, value in self._source().items():
            if value is not None:
                g.add_metric([*self._labels.values(), window], value)
        yield g


class _EngineStateCollector(Collector):
    """Reads gauges and counters off the engine at each scrape."""

    def __init__(self, engine: SimEngine, labels: dict[str, str], cache_labels: dict[str, str]) -> None:
        self._engine = engine
        self._labels = labels
        self._cache_labels = cache_labels

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        m = read_metrics(engine)
        c = engine.sync_counters()
        names = list(self._labels)
        values = list(self._labels.values())

        def gauge(metric: vm.VllmMetric, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric.name, metric.help, labels=names)
            g.add_metric(values, value)
            return g

        def counter(metric: vm.VllmMetric, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(metric.name, metric.help, labels=names)
            m.add_metric(values, value)
            return m

        yield gauge(vm.NUM_REQUESTS_RUNNING, m.num_running)
        yield gauge(vm.NUM_REQUESTS_WAITING, m.num_waiting)
        yield gauge(vm.KV_CACHE_USAGE, m.kv_usage)
        yield counter(vm.NUM_PREEMPTIONS, m.preemptions_total)
        yield counter(vm.PREFIX_CACHE_QUERIES, m.prefix_queries_total)
        yield counter(vm.PREFIX_CACHE_HITS, m.prefix_hits_total)
        yield counter(vm.PROMPT_TOKENS, c.prompt_tokens)
        yield counter(vm.GENERATION_TOKENS, c.generation_tokens)
        success = CounterMetricFamily(
            vm.REQUEST_SUCCESS.name, vm.REQUEST_SUCCESS.help, labels=[*names, vm.FINISHED_REASON_LABEL]
        )
        for reason in FinishReason:
            success.add_metric([*values, reason.value], c.request_success.get(reason.value, 0))
        yield success
        info = GaugeMetricFamily(
            vm.CACHE_CONFIG_INFO.name, vm.CACHE_CONFIG_INFO.help, labels=list(self._cache_labels)
        )
        info.add_metric(list(self._cache_labels.values()), 1.0)
        yield info


class EngineMetrics:
    """The per-engine registry: state collector plus latency histograms."""

    def __init__(self, engine: SimEngine, model_name: str, engine_index: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.engine_index = engine_index
        labels = {vm.ENGINE_LABEL: str(engine_index), vm.MODEL_LABEL: model_name}
        self._labels = labels
        self._keep_up: _KeepUpCollector | None = None
        limits = engine.limits
        cache_labels = {
            vm.BLOCK_SIZE_LABEL: str(limits.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(limits.enable_prefix_caching),
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            vm.NUM_GPU_BLOCKS_LABEL: str(limits.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            vm.ENGINE_LABEL: str(engine_index),
        }
        self.registry.register(_EngineStateCollector(engine, labels, cache_labels))
        self._ttft = self._histogram(vm.TIME_TO_FIRST_TOKEN, labels, vm.TTFT_BUCKETS)
        self._e2e = self._histogram(vm.E2E_REQUEST_LATENCY, labels, vm.REQUEST_LATENCY_BUCKETS)
        self._queue = self._histogram(vm.REQUEST_QUEUE_TIME, labels, vm.REQUEST_LATENCY_BUCKETS)

    def _histogram(self, metric: vm.VllmMetric, labels: dict[str, str], buckets: tuple[float, ...]) -> Histogram:
        family = Histogram(metric.name, metric.help, list(labels), registry=self.registry, buckets=buckets)
        return family.labels(**labels)

    def set_keep_up_source(self, source: KeepUpSource) -> None:
        """Serve ``misat_sim_keep_up_ratio`` from ``source`` (the engine loop's meter)."""
        if self._keep_up is not None:
            self.registry.unregister(self._keep_up)
        self._keep_up = _KeepUpCollector(source, self._labels)
        self.registry.register(self._keep_up)

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
