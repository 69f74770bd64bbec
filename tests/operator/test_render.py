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


class _GoldenDumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's router.yaml) as literal blocks, so goldens read as YAML."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_GoldenDumper.add_representer(str, _str)


def _render_example(path: Path) -> tuple[Any, PoolRef]:
    obj = yaml.safe_load(path.read_text())
    ref = PoolRef(obj["metadata"]["name"], "rl", "0c7f3e8a-1111-4222-8333-944455556666", 7)
    return render(parse_spec(obj["spec"]), ref, TOKEN), ref


@pytest.mark.parametrize("path", POOL_EXAMPLES, ids=lambda p: p.name)
def test_golden(path: Path) -> None:
    desired, _ = _render_example(path)
    text = yaml.dump_all(desired.objects(), Dumper=_GoldenDumper, sort_keys=True)
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
    assert pairs["--model"] == "Qwen/Qwen3-30B-A3B"
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
    ("admission-policy", lambda s: s["admission"].update(policy="misa-t")),
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
