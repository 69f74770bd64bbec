"""Render: golden objects per example, Kubernetes' own schemas, and the restart rules.

Golden files: ``MISAT_UPDATE_GOLDEN=1 pytest tests/operator/test_render.py`` rewrites
``tests/operator/golden/*.yaml`` from the current render; review the diff before committing.
"""

from __future__ import annotations

import copy
import itertools
import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from misat_cli.render import ReviewDumper
from misat_operator.models import parse_spec
from misat_operator.names import CONFIG_KEY
from misat_operator.render import PoolRef, render, token_from_secret
from misat_router.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("MISAT_UPDATE_GOLDEN") == "1"
K8S_VERSION = "1.32.0"
"""The kubectl on this machine; kubernetes-validate ships schemas per minor version."""
POOL_EXAMPLES = [
    p for p in sorted((ROOT / "examples").glob("*.yaml")) if yaml.safe_load(p.read_text()).get("kind") == "RolloutPool"
]
TOKEN = "golden-admin-token"




def _render_example(path: Path) -> tuple[Any, PoolRef]:
    obj = yaml.safe_load(path.read_text())
    ref = PoolRef(obj["metadata"]["name"], "rl", "0c7f3e8a-1111-4222-8333-944455556666", 7)
    return render(parse_spec(obj["spec"]), ref, TOKEN), ref


@pytest.mark.parametrize("path", POOL_EXAMPLES, ids=lambda p: p.name)
def test_golden(path: Path) -> None:
    desired, _ = _render_example(path)
    text = yaml.dump_all(desired.objects(), Dumper=ReviewDumper, sort_keys=True)
    golden = GOLDEN / path.name
    if UPDATE:
        golden.write_text(text)
    assert golden.exists(), f"no golden file: run MISAT_UPDATE_GOLDEN=1 pytest {__file__}"
    assert text == golden.read_text(), f"render of {path.name} changed; if intended, regenerate the goldens"


@pytest.mark.parametrize("path", POOL_EXAMPLES, ids=lambda p: p.name)
def test_rendered_objects_pass_kubernetes_schemas(path: Path) -> None:
    desired, _ = _render_example(path)
    for obj in desired.objects():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_config_map_holds_a_valid_router_config_for_the_headless_service(
    mixed_pool: dict[str, Any], pool_ref: PoolRef
) -> None:
    desired = render(parse_spec(mixed_pool["spec"]), pool_ref, TOKEN)
    config = parse_config(desired.config_map["data"][CONFIG_KEY])
    assert config == desired.router_config
    assert config.generation == pool_ref.generation
    assert config.engines.service is not None
    assert config.engines.service.name == "mixed-pool-engines.rl.svc.cluster.local"
    assert desired.engine_service["spec"]["clusterIP"] == "None"
    assert desired.engine_service["metadata"]["name"] == "mixed-pool-engines"
    assert config.model == "policy"
    assert config.policy.kv_budget_fraction == 0.9
    assert config.workloads.target == pytest.approx({"agentic": 0.486, "rlvr": 0.332, "rlhf": 0.182})
    assert config.hold_deadline_s == 300


def test_engine_args_and_gpus(mixed_pool: dict[str, Any], pool_ref: PoolRef) -> None:
    mixed_pool["spec"]["engines"]["extraArgs"] = ["--enforce-eager"]
    desired = render(parse_spec(mixed_pool["spec"]), pool_ref, TOKEN)
    container = desired.engine_deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    pairs = dict(itertools.pairwise(args))
    assert container["command"] == ["vllm"] and args[:2] == ["serve", "Qwen/Qwen3-30B-A3B"]
    assert "--model" not in args, "vllm serve takes the model as its positional argument"
    assert pairs["--host"] == "::"
    assert pairs["--served-model-name"] == "policy"
    assert pairs["--tensor-parallel-size"] == "4"
    assert pairs["--max-model-len"] == "131072"
    assert pairs["--max-num-seqs"] == "256"
    assert pairs["--max-num-batched-tokens"] == "16384"
    assert pairs["--gpu-memory-utilization"] == "0.9"
    assert "--enable-prefix-caching" in args and "--enable-prompt-tokens-details" in args
    assert args[-1] == "--enforce-eager"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_prefix_caching_can_be_turned_off(mixed_pool: dict[str, Any], pool_ref: PoolRef) -> None:
    mixed_pool["spec"]["engines"]["enablePrefixCaching"] = False
    args = render(parse_spec(mixed_pool["spec"]), pool_ref, TOKEN).engine_deployment["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args


def test_router_command_and_mounts(mixed_pool: dict[str, Any], pool_ref: PoolRef) -> None:
    desired = render(parse_spec(mixed_pool["spec"]), pool_ref, TOKEN)
    pod = desired.router_deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"][:6] == [
        "misat", "router", "--config", "/etc/misat/config/router.yaml",
        "--admin-token-file", "/etc/misat/admin/token",
    ]
    config_mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert "subPath" not in config_mount, "a subPath mount never sees ConfigMap updates"
    assert {"name": "config", "configMap": {"name": "mixed-pool-router-config"}} in pod["volumes"]
    assert token_from_secret(desired.secret) == TOKEN
    assert "annotations" not in desired.router_deployment["spec"]["template"]["metadata"]


ROUTER_ONLY_CHANGES = [
    ("admission-policy", lambda s: s["admission"].update(policy="misa")),
    ("admission-setting", lambda s: s["admission"]["sessionAdmission"].update(confirmEpochs=7)),
    ("workload-shares", lambda s: s["workloads"][0].update(share=38.6) or s["workloads"][1].update(share=43.2)),
    ("new-class", lambda s: s["workloads"].append({"name": "chat", "share": 0})),
    ("kv-budget", lambda s: s["kvBudget"].update(fraction=0.8)),
    ("hold-deadline", lambda s: s["router"].update(holdDeadlineSeconds=120)),
]


@pytest.mark.parametrize(("case", "change"), ROUTER_ONLY_CHANGES, ids=[c[0] for c in ROUTER_ONLY_CHANGES])
def test_config_changes_touch_only_the_config_map(
    mixed_pool: dict[str, Any], pool_ref: PoolRef, case: str, change: Any
) -> None:
    before = render(parse_spec(mixed_pool["spec"]), pool_ref, TOKEN)
    spec = copy.deepcopy(mixed_pool["spec"])
    change(spec)
    after = render(parse_spec(spec), pool_ref, TOKEN)
    assert after.config_map != before.config_map
    assert after.router_deployment == before.router_deployment
    assert after.engine_deployment == before.engine_deployment
    assert after.router_service == before.router_service
    assert after.engine_service == before.engine_service


ENGINE_CHANGES = [
    ("image", lambda e: e.update(image="vllm/vllm-openai:v0.33.0")),
    ("max-model-len", lambda e: e.update(maxModelLen=65536)),
    ("gpu-memory", lambda e: e.update(gpuMemoryUtilization=0.85)),
    ("extra-args", lambda e: e.update(extraArgs=["--enforce-eager"])),
    ("env", lambda e: e["env"].append({"name": "X", "value": "1"})),
]


@pytest.mark.parametrize(("case", "change"), ENGINE_CHANGES, ids=[c[0] for c in ENGINE_CHANGES])
def test_engine_changes_roll_the_engines_and_not_the_router(
    mixed_pool: dict[str, Any], pool_ref: PoolRef, case: str, change: Any
) -> None:
    before = render(parse_spec(mixed_pool["spec"]), pool_ref, TOKEN)
    spec = copy.deepcopy(mixed_pool["spec"])
    change(spec["engines"])
    after = render(parse_spec(spec), pool_ref, TOKEN)
    assert after.engine_deployment["spec"]["template"] != before.engine_deployment["spec"]["template"]
    assert after.router_deployment == before.router_deployment


def test_every_child_is_owned_by_the_pool(mixed_pool: dict[str, Any], pool_ref: PoolRef) -> None:
    for obj in render(parse_spec(mixed_pool["spec"]), pool_ref, TOKEN).objects():
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner["uid"] == pool_ref.uid and owner["controller"] is True
        assert owner["kind"] == "RolloutPool" and owner["apiVersion"] == "misat.dev/v1alpha1"
        assert obj["metadata"]["namespace"] == "rl"
        assert obj["metadata"]["labels"]["misat.dev/pool"] == "mixed-pool"


def test_an_invalid_router_config_fails_the_whole_render(mixed_pool: dict[str, Any], pool_ref: PoolRef) -> None:
    """The RouterConfig is built (and so validated) before any object: a bad one yields nothing."""
    spec = parse_spec(mixed_pool["spec"])
    bad_ref = PoolRef(pool_ref.name, pool_ref.namespace, pool_ref.uid, generation=-1)
    with pytest.raises(ValueError, match="generation"):
        render(spec, bad_ref, TOKEN)


# ---- pods for real GPU clusters ------------------------------------------------------------


def _pods(spec: dict[str, Any], ref: PoolRef) -> tuple[dict[str, Any], dict[str, Any]]:
    desired = render(parse_spec(spec), ref, TOKEN)
    assert desired.engine_deployment is not None
    return desired.engine_deployment["spec"]["template"]["spec"], desired.router_deployment["spec"]["template"]["spec"]


@pytest.mark.parametrize("component", ["engine", "router"])
def test_pods_meet_the_restricted_pod_security_profile(mixed_pool: dict[str, Any], pool_ref: PoolRef, component: str) -> None:
    engine, router = _pods(mixed_pool["spec"], pool_ref)
    pod = engine if component == "engine" else router
    (container,) = pod["containers"]
    psc, sc = pod["securityContext"], container["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0 and psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["automountServiceAccountToken"] is False
    restricted = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
    for volume in pod["volumes"]:
        assert set(volume) - {"name"} <= restricted, volume


def test_engine_pods_cache_models_size_shm_and_stop_gracefully(mixed_pool: dict[str, Any], pool_ref: PoolRef) -> None:
    engine, _ = _pods(mixed_pool["spec"], pool_ref)
    (container,) = engine["containers"]
    env = {v["name"]: v.get("value") for v in container["env"]}
    assert env["HF_HOME"] == "/cache/huggingface" and env["VLLM_CACHE_ROOT"] == "/cache/vllm"
    volumes = {v["name"]: v for v in engine["volumes"]}
    assert volumes["model-cache"]["emptyDir"] == {"sizeLimit": "200Gi"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/cache", "/dev/shm"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["timeoutSeconds"] == 10, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1800
    args = container["args"]
    assert args[args.index("--shutdown-timeout") + 1] == "600"
    assert container["lifecycle"]["preStop"] == {"sleep": {"seconds": 10}}
    assert engine["terminationGracePeriodSeconds"] == 10 + 600 + 30


def test_pod_settings_are_rendered(mixed_pool: dict[str, Any], pool_ref: PoolRef) -> None:
    e = mixed_pool["spec"]["engines"]
    e.update(
        imagePullSecrets=[{"name": "registry"}], serviceAccountName="engines", runtimeClassName="nvidia",
        priorityClassName="rollouts", podLabels={"team": "rl"}, podAnnotations={"example.com/owner": "rl"},
        securityContext={"runAsUser": 2000}, shmSize="32Gi",
        modelCache={"claimName": "hf-cache", "mountPath": "/hf"},
        probes={"timeoutSeconds": 30, "startupBudgetSeconds": 3600},
        shutdown={"preStopSleepSeconds": 20, "drainSeconds": 1200},
        disruptionBudget={"maxUnavailable": 2},
        affinity={"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 50, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                               "labelSelector": {"matchLabels": {"misat.dev/pool": "mixed-pool"}}}}]}},
        topologySpreadConstraints=[{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                    "whenUnsatisfiable": "ScheduleAnyway"}],
    )
    desired = render(parse_spec(mixed_pool["spec"]), pool_ref, TOKEN)
    assert desired.engine_deployment is not None and desired.engine_disruption_budget is not None
    template = desired.engine_deployment["spec"]["template"]
    pod = template["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert (pod["serviceAccountName"], pod["runtimeClassName"], pod["priorityClassName"]) == ("engines", "nvidia", "rollouts")
    assert template["metadata"]["labels"]["team"] == "rl"
    assert template["metadata"]["labels"]["misat.dev/pool"] == "mixed-pool"
    assert template["metadata"]["annotations"] == {"example.com/owner": "rl"}
    assert pod["securityContext"]["runAsUser"] == 2000 and pod["securityContext"]["fsGroup"] == 2000
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "hf-cache"}
    assert volumes["dshm"]["emptyDir"]["sizeLimit"] == "32Gi"
    (container,) = pod["containers"]
    assert {v["name"]: v.get("value") for v in container["env"]}["HF_HOME"] == "/hf/huggingface"
    assert container["livenessProbe"]["timeoutSeconds"] == 30
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] == 3600
    assert pod["terminationGracePeriodSeconds"] == 20 + 1200 + 30
    assert pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 50
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["labelSelector"] == {"matchLabels": {"app.kubernetes.io/component": "engine", "misat.dev/pool": "mixed-pool"}}
    assert desired.engine_disruption_budget["spec"]["maxUnavailable"] == 2
    for obj in desired.objects():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_engine_disruption_budget_selects_the_engine_pods(mixed_pool: dict[str, Any], pool_ref: PoolRef) -> None:
    desired = render(parse_spec(mixed_pool["spec"]), pool_ref, TOKEN)
    pdb, deployment = desired.engine_disruption_budget, desired.engine_deployment
    assert pdb is not None and deployment is not None
    assert pdb["kind"] == "PodDisruptionBudget" and pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb in desired.objects()


def test_router_listens_on_every_family_and_drains_within_its_grace(mixed_pool: dict[str, Any], pool_ref: PoolRef) -> None:
    _, router = _pods(mixed_pool["spec"], pool_ref)
    (container,) = router["containers"]
    command = container["command"]
    assert command[command.index("--host") + 1] == ""
    from misat_router.config import RouterConfig

    assert router["terminationGracePeriodSeconds"] > RouterConfig.model_fields["drain_timeout_s"].default + 10


# ---- bring your own engines ------------------------------------------------------------------


def _external(mixed_pool: dict[str, Any], external: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(mixed_pool["spec"])
    spec["engines"] = {"external": external}
    return spec


def test_external_service_renders_only_the_router(mixed_pool: dict[str, Any], pool_ref: PoolRef) -> None:
    spec = _external(mixed_pool, {"service": {"name": "fleet", "namespace": "inference", "port": 9000}})
    desired = render(parse_spec(spec), pool_ref, TOKEN)
    assert desired.engine_deployment is None and desired.engine_service is None
    assert desired.engine_disruption_budget is None
    assert [o["kind"] for o in desired.objects()] == ["Secret", "ConfigMap", "Service", "Deployment"]
    service = desired.router_config.engines.service
    assert service is not None
    assert (service.name, service.port) == ("fleet.inference.svc.cluster.local", 9000)
    assert parse_config(desired.config_map["data"][CONFIG_KEY]) == desired.router_config


def test_external_urls_go_to_the_router_config(mixed_pool: dict[str, Any], pool_ref: PoolRef) -> None:
    urls = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    desired = render(parse_spec(_external(mixed_pool, {"urls": urls})), pool_ref, TOKEN)
    assert desired.router_config.engines.urls == tuple(urls)
    assert desired.engine_deployment is None


def test_a_pool_can_switch_between_external_and_created_engines(mixed_pool: dict[str, Any], pool_ref: PoolRef) -> None:
    """Only the router config changes for the router: its Deployment is the same either way."""
    own = render(parse_spec(mixed_pool["spec"]), pool_ref, TOKEN)
    byo = render(parse_spec(_external(mixed_pool, {"urls": ["http://e:8000"]})), pool_ref, TOKEN)
    assert own.router_deployment == byo.router_deployment
    assert own.config_map != byo.config_map


# ---- sizes ---------------------------------------------------------------------------------


def test_render_refuses_objects_whose_annotations_would_overflow(mixed_pool: dict[str, Any], pool_ref: PoolRef) -> None:
    """The last guard before any write: each object's last-applied record (an annotation, added by the
    apply step) must fit Kubernetes' 256 KiB of annotations. Pod annotations and env that pass on their
    own add up in the Deployment's record."""
    from misat_operator.render import size_problem

    desired = render(parse_spec(mixed_pool["spec"]), pool_ref, TOKEN)
    assert desired.engine_deployment is not None
    assert all(size_problem(o) is None for o in desired.objects())
    big = copy.deepcopy(desired.engine_deployment)
    pod = big["spec"]["template"]
    pod["metadata"]["annotations"] = {"example.com/blob": "x" * 150_000}
    pod["spec"]["containers"][0]["env"].append({"name": "BLOB", "value": "y" * 120_000})
    problem = size_problem(big)
    assert problem is not None and "Deployment mixed-pool-engines" in problem and "262144" in problem


def test_a_spec_too_large_for_the_pools_own_annotations_is_refused(mixed_pool: dict[str, Any]) -> None:
    from misat_operator.models import MAX_SPEC_BYTES, describe_spec_error

    spec = copy.deepcopy(mixed_pool["spec"])
    spec["engines"]["env"] += [{"name": f"V{i}", "value": "z" * 30_000} for i in range(4)]
    with pytest.raises(ValidationError) as err:
        parse_spec(spec)
    message = describe_spec_error(err.value)
    assert message.startswith("spec: ") and f"above {MAX_SPEC_BYTES}" in message
