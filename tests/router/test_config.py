"""RouterConfig: validation with path-naming errors, defaults, stable hash, file loading."""

from __future__ import annotations

from pathlib import Path

import pytest

from misat_router.config import ConfigError, RouterConfig, load_config, parse_config

MINIMAL = """
model: tiny
engines: {urls: ["http://e1:8000/", "http://e2:8000"]}
workloads:
  classes:
    - {name: rlvr, share: 60}
    - {name: agentic, share: 40, multi_turn: true}
"""


def test_minimal_yaml_gets_documented_defaults() -> None:
    cfg = parse_config(MINIMAL)
    assert cfg.generation == 0
    assert cfg.engines.static_urls() == ("http://e1:8000", "http://e2:8000")
    assert cfg.policy.name.value == "session-admission"
    assert cfg.hold_deadline_s == 300.0 and cfg.max_placement_attempts == 3
    # Every field is documented (the docs table is generated from these).
    for name, field in RouterConfig.model_fields.items():
        assert field.description, name


def test_hash_is_stable_and_tracks_content() -> None:
    a, b = parse_config(MINIMAL), parse_config(MINIMAL)
    assert a.config_hash() == b.config_hash()
    assert a.config_hash() != a.model_copy(update={"generation": 5}).config_hash()
    assert a.config_hash() == RouterConfig.model_validate_json(a.model_dump_json()).config_hash()


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param(MINIMAL.replace("share: 60", "share: 70"), "shares must sum to 100",
                     id="shares"),
        pytest.param(MINIMAL + "bogus: 1\n", "bogus", id="unknown-key"),
        pytest.param(MINIMAL.replace("share: 60", "share: lots"), "workloads.classes[0].share",
                     id="path-named"),
        pytest.param(MINIMAL.replace('{urls: ["http://e1:8000/", "http://e2:8000"]}',
                                     '{urls: ["e1:8000"]}'), "must start with http", id="url"),
        pytest.param(MINIMAL.replace('{urls: ["http://e1:8000/", "http://e2:8000"]}',
                                     "{urls: [http://a:1], service: {name: x}}"),
                     "exactly one", id="urls-and-service"),
        pytest.param("[1, 2]", "mapping", id="not-a-mapping"),
        pytest.param("model: [unclosed", "YAML", id="bad-yaml"),
        pytest.param(MINIMAL + "hold_deadline_s: 0\n", "hold_deadline_s", id="deadline-positive"),
    ],
)
def test_invalid_configs_name_the_problem(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert fragment in str(info.value)


def test_service_engines_and_json_file(tmp_path: Path) -> None:
    cfg = parse_config(MINIMAL.replace('{urls: ["http://e1:8000/", "http://e2:8000"]}',
                                       "{service: {name: engines.ns.svc, port: 8001}}"))
    assert cfg.engines.static_urls() is None and cfg.engines.service is not None
    path = tmp_path / "router.json"
    path.write_text(cfg.model_dump_json())
    assert load_config(path) == cfg
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_pathological_documents_are_config_errors_not_crashes() -> None:
    import pytest

    from misat_router.config import ConfigError

    for text in ('{"a": ' * 5000 + "1" + "}" * 5000, "x: " + "9" * 5000, "[" * 3000):
        with pytest.raises(ConfigError):
            parse_config(text)
