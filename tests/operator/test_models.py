"""The RolloutPool spec model: camelCase wire shape, the router's settings reused, the operator's checks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from misat_operator.engine_args import MANAGED
from misat_operator.models import (
    CLASS_NAME_PATTERN,
    RolloutPoolSpec,
    describe_spec_error,
    parse_spec,
    pool_name_error,
)
from misat_operator.vllm_flags import FLAGS
from misat_router.policy.settings import ClassSpec, PolicyName, PolicySettings


def test_minimal_spec_takes_router_defaults() -> None:
    spec = parse_spec({"model": {"name": "m"}, "workloads": [{"name": "rlvr", "share": 100}]})
    assert spec.admission == PolicySettings()
    assert spec.kv_budget.fraction == PolicySettings().kv_budget_fraction
    assert spec.engines.enable_prefix_caching is True
    assert spec.engines.image.startswith("vllm/vllm-openai:")
    assert spec.model.served == "m"


def test_admission_is_the_routers_policy_settings_in_camel_case() -> None:
    spec = parse_spec({
        "model": {"name": "m"},
        "workloads": [{"name": "a", "share": 100}],
        "admission": {
            "policy": "misa",
            "concurrencyLimit": 64,
            "sessionAdmission": {"epochS": 0.25, "confirmEpochs": 5},
            "cacheAware": {"maxTreeSize": 1024},
        },
    })
    assert spec.admission.name is PolicyName.MISA
    assert spec.admission.concurrency_limit == 64
    assert spec.admission.admission.epoch_s == 0.25
    assert spec.admission.admission.confirm_epochs == 5
    assert spec.admission.cache_aware.max_tree_size == 1024
    dumped = spec.model_dump(by_alias=True)["admission"]
    assert dumped["policy"] == "misa"
    assert dumped["sessionAdmission"]["confirmEpochs"] == 5
    assert "kvBudgetFraction" not in dumped
    assert parse_spec(spec.model_dump(by_alias=True)) == spec


@pytest.mark.parametrize(
    "admission",
    [
        pytest.param({"kvBudgetFraction": 0.5}, id="budget-belongs-to-kvBudget"),
        pytest.param({"sessionAdmission": {"epochSeconds": 1}}, id="unknown-nested-setting"),
        pytest.param({"policy": "fastest"}, id="unknown-policy"),
        pytest.param({"footprint": {"statistic": "p90"}}, id="bad-statistic"),
    ],
)
def test_admission_rejects_unknown_or_misplaced_settings(admission: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        parse_spec({"model": {"name": "m"}, "workloads": [{"name": "a", "share": 100}], "admission": admission})


def _with(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(base)
    node = spec
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
    last = keys[-1]
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return spec


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("workloads.0.share", 40.0, "sum to 100"),
        ("workloads.1.name", "agentic", "unique"),
        ("workloads.2.minKvShare", 0.9, "above maxKvShare"),
        ("defaultClass", "chat", "defaultClass"),
        ("engines.tensorParallelSize", 8, "tensorParallelSize"),
        ("engines.extraArgs", ["--port=9000"], "spec.engines.extraArgs[0]: --port is set by the operator from spec.engines.port"),
        ("engines.replicas", -1, "greater than or equal"),
        ("engines.gpuMemoryUtilization", 0.0, "greater than 0"),
        ("engines.gpu", 1, "Extra inputs"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
def test_invalid_specs_name_the_problem(mixed_pool: dict[str, Any], path: str, value: Any, needle: str) -> None:
    bad = _with(mixed_pool["spec"], path, value)
    with pytest.raises(ValidationError) as err:
        parse_spec(bad)
    assert needle in describe_spec_error(err.value)


def test_min_shares_summing_above_one_are_rejected(mixed_pool: dict[str, Any]) -> None:
    spec = mixed_pool["spec"]
    for w in spec["workloads"]:
        w.pop("maxKvShare", None)
        w["minKvShare"] = 0.4
    with pytest.raises(ValidationError, match="minKvShare values sum"):
        parse_spec(spec)


def test_class_name_pattern_matches_the_routers() -> None:
    router = ClassSpec.model_json_schema()["properties"]["name"]["pattern"]
    assert router == CLASS_NAME_PATTERN


def test_every_flag_set_from_a_typed_field_is_refused_in_extra_args() -> None:
    base = {"model": {"name": "m"}, "workloads": [{"name": "a", "share": 100}]}
    typed = {dest for dest in MANAGED if dest != "model_tag"}
    flags = sorted({flag for flag, (dest, _) in FLAGS.items() if dest in typed})
    assert "--max-num-seqs" in flags and "-tp" in flags and "--no-enable-prefix-caching" in flags
    for flag in flags:
        with pytest.raises(ValidationError, match=r"set by the operator from spec\."):
            parse_spec({**base, "engines": {"extraArgs": [flag, "8"] if FLAGS[flag][1] != "switch" else [flag]}})
    ok = parse_spec({**base, "engines": {"extraArgs": ["--enforce-eager", "--kv-cache-dtype=fp8"]}})
    assert ok.engines.extra_args == ["--enforce-eager", "--kv-cache-dtype=fp8"]


def test_spec_models_are_frozen() -> None:
    spec = RolloutPoolSpec.model_validate({"model": {"name": "m"}, "workloads": [{"name": "a", "share": 100}]})
    with pytest.raises(ValidationError):
        spec.engines.replicas = 3  # type: ignore[misc]


def test_pool_name_length() -> None:
    assert pool_name_error("a" * 40) is None
    assert "at most 40" in (pool_name_error("a" * 41) or "")
    assert pool_name_error("") == "metadata.name is required"  # a manifest for misat up or render


def test_operator_settings_from_environment() -> None:
    from misat_operator.settings import SettingsError, from_env

    settings = from_env({"MISAT_OPERATOR_STATUS_INTERVAL_S": "2.5", "MISAT_OPERATOR_ROUTER_URL": "http://r:{port}/"})
    assert settings.status_interval_s == 2.5
    assert settings.router_base_url("p", "ns", 8080) == "http://r:8080"
    assert from_env({}).router_base_url("p", "ns", 8080) == "http://p-router.ns.svc.cluster.local:8080"
    with pytest.raises(SettingsError, match="MISAT_OPERATOR_STATUS_INTERVAL_S"):
        from_env({"MISAT_OPERATOR_STATUS_INTERVAL_S": "-1"})


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("pool.v2", "metadata.name: 'pool.v2' cannot name a Service (pool.v2-engines): a DNS-1035 label"),
        ("7b-pool", "metadata.name: '7b-pool' cannot name a Service (7b-pool-engines): a DNS-1035 label"),
        ("Pool", "metadata.name: 'Pool' cannot name a"),
    ],
)
def test_pool_names_must_fit_every_child_kind(name: str, needle: str) -> None:
    assert needle in (pool_name_error(name) or "")


def test_effective_values_are_the_pools_own_or_this_releases_defaults() -> None:
    from misat_operator.models import (
        DEFAULT_MODEL_CACHE_SIZE,
        ENGINE_DRAIN_S,
        ENGINE_PROBE_TIMEOUT_S,
        effective_values,
    )
    from misat_router.config import RouterConfig, ShardsConfig

    minimal = parse_spec({"model": {"name": "m"}, "workloads": [{"name": "a", "share": 100}]})
    eff = effective_values(minimal)
    assert eff["admission"]["sessionAdmission"]["epochS"] == PolicySettings().admission.epoch_s
    assert eff["kvBudget"]["fraction"] == PolicySettings().kv_budget_fraction
    assert eff["router"]["holdDeadlineSeconds"] == RouterConfig.model_fields["hold_deadline_s"].default
    assert eff["engines"]["probes"]["timeoutSeconds"] == ENGINE_PROBE_TIMEOUT_S
    assert eff["engines"]["shutdown"]["drainSeconds"] == ENGINE_DRAIN_S
    assert eff["engines"]["modelCache"]["sizeLimit"] == DEFAULT_MODEL_CACHE_SIZE
    assert "gpuMemoryUtilization" not in eff["engines"], "unset: vLLM's own default applies"

    tuned = parse_spec({
        "model": {"name": "m"}, "workloads": [{"name": "a", "share": 100}],
        "admission": {"sessionAdmission": {"epochS": 0.25}},
        "router": {"holdDeadlineSeconds": 60},
        "engines": {"probes": {"timeoutSeconds": 30}, "shutdown": {"drainSeconds": 0}, "gpuMemoryUtilization": 0.8,
                    "modelCache": {"claimName": "hf"}},
    })
    eff = effective_values(tuned)
    assert eff["admission"]["sessionAdmission"]["epochS"] == 0.25
    assert eff["router"]["holdDeadlineSeconds"] == 60
    assert eff["engines"]["probes"]["timeoutSeconds"] == 30
    assert eff["engines"]["shutdown"]["drainSeconds"] == 0
    assert eff["engines"]["terminationGracePeriodSeconds"] == 10 + 0 + 30
    assert eff["engines"]["gpuMemoryUtilization"] == 0.8
    assert eff["engines"]["modelCache"] == {"claimName": "hf", "sizeLimit": None, "mountPath": "/cache"}
    external = parse_spec({"model": {"name": "m"}, "workloads": [{"name": "a", "share": 100}],
                           "engines": {"external": {"urls": ["http://e:8000"]}}})
    assert "engines" not in effective_values(external)
    assert "handbackIdleSeconds" not in eff["router"]  # one router: no shards to hand engines back to
    sharded = parse_spec({"model": {"name": "m"}, "workloads": [{"name": "a", "share": 100}],
                          "engines": {"replicas": 2}, "router": {"shards": 2}})
    assert effective_values(sharded)["router"]["handbackIdleSeconds"] == ShardsConfig.model_fields[
        "handback_idle_s"].default
    sharded = parse_spec({"model": {"name": "m"}, "workloads": [{"name": "a", "share": 100}],
                          "engines": {"replicas": 2}, "router": {"shards": 2, "handbackIdleSeconds": 0}})
    assert effective_values(sharded)["router"]["handbackIdleSeconds"] == 0


def test_a_spec_stores_only_what_its_author_wrote() -> None:
    """The model fills defaults at reconcile time; nothing of them is in the written fields, so a later
    release's defaults reach the pool (the CRD has no defaults either: test_crd.py)."""
    written = {"model": {"name": "m"}, "workloads": [{"name": "a", "share": 100}], "admission": {"policy": "misa"}}
    spec = parse_spec(written)
    assert spec.model_fields_set == {"model", "workloads", "admission"}
    assert spec.engines.model_fields_set == set()


def test_admission_errors_use_the_manifest_names() -> None:
    with pytest.raises(ValidationError) as err:
        parse_spec({"model": {"name": "m"}, "workloads": [{"name": "a", "share": 100}],
                    "admission": {"sessionAdmission": {"epochS": 0}, "cacheAware": {"maxTreeSize": -1}}})
    message = describe_spec_error(err.value)
    assert "spec.admission.sessionAdmission.epochS: " in message
    assert "spec.admission.cacheAware.maxTreeSize: " in message
    assert "epoch_s" not in message and ".admission.admission" not in message


def test_gpus_in_resources_are_refused_in_favour_of_gpus_per_replica() -> None:
    with pytest.raises(ValidationError) as err:
        parse_spec({"model": {"name": "m"}, "workloads": [{"name": "a", "share": 100}],
                    "engines": {"resources": {"limits": {"nvidia.com/gpu": 8}}}})
    assert "spec.engines.resources.limits[nvidia.com/gpu]: is set from gpusPerReplica" in describe_spec_error(err.value)


def test_a_target_budget_basis_without_misa_t_is_named_by_its_manifest_path() -> None:
    raw = {"model": {"name": "m"}, "workloads": [{"name": "a", "share": 100}],
           "admission": {"policy": "misa", "budgetBasis": "target"}}
    with pytest.raises(ValidationError) as exc:
        RolloutPoolSpec.model_validate(raw)
    assert describe_spec_error(exc.value) == (
        "spec.admission.budgetBasis: target weighs classes by their residency time, which only misa-t "
        "estimates; the policy is misa"
    )
    raw["admission"]["policy"] = "misa-t"  # type: ignore[index]
    assert RolloutPoolSpec.model_validate(raw).admission.budget_basis == "target"
