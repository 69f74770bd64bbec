"""The vLLM metrics contract (``misat_router.vllm_metrics``) seen from both sides.

What the simulator's exporter serves, parsed by the router's parser, must be the
engine the cluster simulator hands its policy (``read_metrics``): the HTTP path and
the in-process path read the same numbers, under vLLM's names.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from misat_router import vllm_metrics as vm
from misat_router.policy.types import EngineSnapshot
from misat_sim.metrics import EngineMetrics, read_metrics

from .conftest import tiny_engine


def _busy_engine():
    """Shared prefixes (hits), more work than KV (preemptions), steps half done (running, waiting)."""
    e = tiny_engine(num_gpu_blocks=30, max_model_len=64)
    prefix = list(range(10, 34))
    for i in range(8):
        e.add_request(f"r{i}", [*prefix, 100 + i, 101 + i], 40, ignore_eos=True, arrival_time=0.0)
    t = 0.0
    for _ in range(30):
        t = e.step(t).end
    return e


def test_exported_page_parses_to_the_snapshot_the_cluster_uses() -> None:
    e = _busy_engine()
    page = EngineMetrics(e, "tiny").render().decode()
    parsed, seen = vm.parse_vllm_page(page)
    direct = read_metrics(e)
    assert seen
    assert parsed == direct
    # Non-trivial on every field, or the equality above proves little.
    assert direct.num_running > 0 and direct.num_waiting > 0 and direct.kv_usage > 0
    assert direct.prefix_hits_total > 0 and direct.preemptions_total > 0
    assert direct.kv_capacity_tokens == 30 * 4


def test_every_exported_series_is_a_contract_metric() -> None:
    contract = {
        m.name: m for m in vars(vm).values() if isinstance(m, vm.VllmMetric)
    }
    metrics = EngineMetrics(_busy_engine(), "tiny")
    metrics.set_keep_up_source(lambda: {"run": 0.97, "recent": None})
    page = metrics.render().decode()
    families = list(text_string_to_metric_families(page))
    assert "misat_sim_keep_up_ratio" in {f.name for f in families}
    assert not any(f.name.startswith(vm.PREFIX) and "keep_up" in f.name for f in families)
    assert families
    for family in families:
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation timestamps, as on a real vLLM server
        if family.name.startswith("misat_sim_"):
            continue  # the simulator's own series (keep-up), under its own prefix
        # prometheus_client's parser drops a counter's _total from the family name.
        spec = contract.get(family.name)
        assert spec is not None, f"{family.name} is served but not in the contract"
        assert family.type == spec.kind.value
        assert family.documentation == spec.help


def test_snapshot_from_metrics_keeps_every_contract_field() -> None:
    m = read_metrics(_busy_engine())
    snap = EngineSnapshot.from_metrics("e0", m, healthy=False, scraped_at=3.0)
    assert (snap.engine_id, snap.healthy, snap.scraped_at) == ("e0", False, 3.0)
    assert vm.VllmMetrics(**{f: getattr(snap, f) for f in vm.VllmMetrics.__dataclass_fields__}) == m
    blind = EngineSnapshot.from_metrics("e0", m.without_load(), healthy=True, scraped_at=3.0)
    assert (blind.kv_usage, blind.num_running, blind.num_waiting) == (0.0, 0, 0)
    assert blind.kv_capacity_tokens == m.kv_capacity_tokens and blind.prefix_hits_total == m.prefix_hits_total
