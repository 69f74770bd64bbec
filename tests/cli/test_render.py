"""``misat render``: a manifest's objects as the operator renders them, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from misat_cli.main import main
from misat_cli.render import PLACEHOLDER_TOKEN
from misat_operator.models import parse_spec
from misat_operator.render import PoolRef, render

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml")
                  if yaml.safe_load(p.read_text()).get("kind") == "RolloutPool")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_an_example_renders_to_the_operators_objects(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "-f", str(example), "-n", "rl"]) == 0
    out = capsys.readouterr().out
    objects = [d for d in yaml.safe_load_all(out) if d]
    doc = yaml.safe_load(example.read_text())
    ref = PoolRef(doc["metadata"]["name"], "rl", "00000000-0000-0000-0000-000000000000", 1)
    want = [o for o in render(parse_spec(doc["spec"]), ref, "t").objects() if o["kind"] != "Secret"]
    assert objects == want
    assert PLACEHOLDER_TOKEN not in out and f"Secret {ref.names.admin_secret}" in out.splitlines()[0]
    for obj in objects:
        assert obj["metadata"]["namespace"] == "rl"
        kubernetes_validate.validate(obj, "1.32.0", strict=True)


def test_json_output_and_the_manifests_own_namespace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "mixed-pool.yaml").read_text())
    doc["metadata"]["namespace"] = "rollouts"
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["render", "-f", str(path), "-n", "ignored", "-o", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["kind"] == "List" and len(listed["items"]) == 6
    assert {o["metadata"]["namespace"] for o in listed["items"]} == {"rollouts"}


def test_an_invalid_manifest_is_refused_with_the_operators_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "mixed-pool.yaml").read_text())
    doc["spec"]["engines"]["replicas"] = -1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert main(["render", "-f", str(bad), "-f", str(ROOT / "examples" / "mixed-pool.yaml"), "--check"]) == 1
    out, err = capsys.readouterr()
    assert f"{bad}: invalid RolloutPool 'mixed-pool'" in err and "spec.engines.replicas" in err
    # The other pool is still checked.
    assert out.splitlines() == [f"{ROOT / 'examples' / 'mixed-pool.yaml'}: RolloutPool default/mixed-pool is valid (6 objects)"]


def test_a_stream_of_documents_from_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What ``kustomize build | misat render -f -`` gives it: every RolloutPool, other kinds passed over."""
    import io

    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "rl"}}
    pools = [yaml.safe_load((ROOT / "examples" / name).read_text()) for name in ("mixed-pool.yaml", "sharded-pool.yaml")]
    stream = yaml.safe_dump_all([namespace, *pools])
    monkeypatch.setattr("sys.stdin", io.StringIO(stream))
    assert main(["render", "-f", "-", "--check"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "<stdin> (document 2): RolloutPool default/mixed-pool is valid (6 objects)",
        "<stdin> (document 3): RolloutPool default/sharded-pool is valid (10 objects)",
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO(yaml.safe_dump(namespace)))
    assert main(["render", "-f", "-"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "<stdin>: no RolloutPool in it" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("spec: [\n"))
    assert main(["render", "-f", "-"]) == 1
    assert "<stdin>:2:1: not valid YAML" in capsys.readouterr().err


def test_a_render_time_refusal_is_reported_too(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What only the renderer finds (a child's annotations past Kubernetes' limit, a router config
    the router refuses) comes as a ValueError, which the operator reports as InvalidSpec: here too."""
    import misat_cli.render as cli_render

    def refuse(*_: object, **__: object) -> object:
        raise ValueError("Deployment mixed-pool-engines would carry 300000 bytes of annotations, above 262144")

    monkeypatch.setattr(cli_render, "render", refuse)
    assert main(["render", "-f", str(ROOT / "examples" / "mixed-pool.yaml")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "invalid RolloutPool 'mixed-pool': Deployment mixed-pool-engines would carry" in err


def _refused_cases() -> list[tuple[str, str, object]]:
    from tests.operator.test_crd import CEL_CASES, MODEL_ONLY

    return [(case, path, value) for case, path, value, _ in CEL_CASES + MODEL_ONLY]


@pytest.mark.parametrize(("case", "path", "value"), _refused_cases(), ids=[c[0] for c in _refused_cases()])
def test_render_refuses_what_the_operator_refuses_with_its_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, path: str, value: object
) -> None:
    """Every manifest the operator would stall on (the cross-field and model-only cases of
    tests/operator/test_crd.py) fails here with the operator's own message (``handlers.validate``)."""
    from misat_operator.handlers import InvalidPool, validate
    from tests.operator.test_crd import _get, _set

    doc = yaml.safe_load((ROOT / "examples" / "mixed-pool.yaml").read_text())
    parent, _, key = path.partition("|")
    bad = _set(doc, parent, {**_get(doc, parent), key: value}) if key else _set(doc, path, value)
    with pytest.raises(InvalidPool) as operator_says:
        validate(bad["spec"], bad["metadata"]["name"])
    manifest = tmp_path / f"{case}.yaml"
    manifest.write_text(yaml.safe_dump(bad))
    assert main(["render", "-f", str(manifest), "--check"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and str(operator_says.value) in err
