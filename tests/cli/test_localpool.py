"""`misat up`'s local pool: the operator's validation and rendering, real processes, live reload."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from openai import AsyncOpenAI, OpenAI

from misat_cli.localpool import LocalPool, PoolError, load_manifest, local_pool, render_local_config
from misat_cli.up import main as up_main
from misat_operator.render import PoolRef, build_router_config
from misat_router.policy.settings import PolicyName
from tests.support.manifests import EXAMPLE, one_engine_manifest
from tests.support.processes import taken_port


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("kind: Deployment\n", "not a RolloutPool manifest"),
        ("{ not: yaml: at all", "not valid YAML"),
        ("apiVersion: misat.dev/v1alpha1\nkind: RolloutPool\nmetadata: {name: p}\n"
         "spec: {model: {name: m}, workloads: [{name: a, share: 60}, {name: b, share: 30}]}\n", "sum to 100"),
    ],
    ids=["wrong-kind", "bad-yaml", "shares-not-100"],
)
def test_bad_manifests_are_refused_with_the_reason(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(PoolError, match=needle) as err:
        load_manifest(path)
    assert str(path) in str(err.value)


def test_missing_manifest_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PoolError, match="cannot read"):
        load_manifest(tmp_path / "absent.yaml")


def test_local_config_is_the_operators_with_local_engines() -> None:
    name, spec = load_manifest(EXAMPLE)
    local = render_local_config(name, spec, ["http://127.0.0.1:9"], 1)
    operator = build_router_config(spec, PoolRef(name=name, namespace="local", uid="local", generation=1))
    assert local.engines.urls == ("http://127.0.0.1:9",)
    assert local.model_dump(exclude={"engines"}) == operator.model_dump(exclude={"engines"})


def test_simulated_lengths_scale_the_footprint_prior_only_where_unset() -> None:
    name, spec = load_manifest(EXAMPLE)
    local = render_local_config(name, spec, ["http://127.0.0.1:9"], 1, length_scale=1 / 16,
                                policy=PolicyName.CACHE_AWARE)
    prior = local.policy.footprint.bootstrap_tokens / 16
    assert {c.bootstrap_footprint_tokens for c in local.workloads.classes} == {round(prior)}
    assert local.policy.name is PolicyName.CACHE_AWARE


async def test_local_pool_serves_and_reloads_admission_live(tmp_path: Path) -> None:
    manifest = one_engine_manifest(tmp_path)
    async with local_pool(manifest, time_scale=200.0) as pool:
        assert isinstance(pool, LocalPool) and len(pool.engine_urls) == 1
        client = AsyncOpenAI(base_url=f"{pool.router_url}/v1", api_key="unused",
                             default_headers={"X-Rollout-Class": "rlhf"})
        out = await client.completions.create(model=pool.spec.model.served, prompt=[5, 6, 7, 8], max_tokens=4)
        assert out.usage is not None and out.usage.completion_tokens == 4
        await client.close()
        [keep_up] = await pool.engine_keep_up()  # the simulated engine's own figures
        assert keep_up is not None and keep_up["busy_s"] > 0 and keep_up["url"] == pool.engine_urls[0]
        before = await pool.status()
        assert before["generation"] == 1
        edited = yaml.safe_load(manifest.read_text())
        edited["spec"]["kvBudget"]["fraction"] = 0.5
        manifest.write_text(yaml.safe_dump(edited))
        message = await pool.reload(manifest)
        assert "applied generation 2" in message
        # The change is named as the manifest spells it.
        assert "spec.kvBudget.fraction: 0.9 -> 0.5" in message
        assert message.endswith("learned footprints and residencies kept")  # a budget change keeps them
        after = await pool.status()
        assert after["generation"] == 2
        assert after["policy_state"]["engines"] or after["policy"] == "misa-t"
        # An engine change is refused: it needs the engines rolled, not a reload.
        edited["spec"]["engines"]["replicas"] = 2
        manifest.write_text(yaml.safe_dump(edited))
        with pytest.raises(PoolError, match="restart"):
            await pool.reload(manifest)
        assert (await pool.status())["generation"] == 2


async def test_the_router_serves_while_the_callers_event_loop_is_blocked(tmp_path: Path) -> None:
    """A trainer that calls the synchronous OpenAI client from a coroutine blocks its own loop
    until the answer comes; a router on that loop could never answer (the call would time out),
    so the local pool's router runs on a loop of its own."""
    async with local_pool(one_engine_manifest(tmp_path), time_scale=200.0) as pool:
        with OpenAI(base_url=f"{pool.router_url}/v1", api_key="unused", max_retries=0, timeout=60.0,
                    default_headers={"X-Rollout-Class": "rlhf"}) as client:
            # Blocking on purpose: nothing else on this loop runs until it returns.
            out = client.completions.create(model=pool.spec.model.served, prompt=[5, 6, 7, 8], max_tokens=4)
        assert out.usage is not None and out.usage.completion_tokens == 4


def test_up_reports_a_taken_port_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = one_engine_manifest(tmp_path)
    with taken_port() as port:
        code = up_main(["-f", str(manifest), "--port", str(port), "--time-scale", "200"])
    assert code == 1
    err = capsys.readouterr().err
    assert "cannot listen" in err
    assert not any("/cli/" in tb or "/router/" in tb for tb in err.split("Traceback")[1:]), err


def test_a_yaml_error_names_the_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text("kind: RolloutPool\nmetadata:\n  name: x\nspec:\n  model: {name: m\n  engines: 3\n")
    with pytest.raises(PoolError) as err:
        load_manifest(path)
    assert str(err.value).startswith(f"{path}:6:10: not valid YAML: expected ',' or '}}'")
    assert "<unicode string>" not in str(err.value)


def test_up_reports_an_invalid_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: RolloutPool\nmetadata: {name: x}\nspec: {}\n")
    assert up_main(["-f", str(bad)]) == 1
    assert "invalid RolloutPool" in capsys.readouterr().err


async def test_an_unreachable_engine_url_is_a_warning_and_requests_fail_fast(tmp_path: Path) -> None:
    import aiohttp

    from misat_cli.processes import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with local_pool(one_engine_manifest(tmp_path), engine_urls=[dead], port=0) as pool:
        assert len(pool.warnings) == 1 and pool.warnings[0].startswith(f"{dead}: unreachable")
        # The manifest's router settings apply; a request fails within the short no-engine wait.
        wait_s = pool.config.no_healthy_engine_wait_s
        assert wait_s < pool.config.hold_deadline_s
        async with aiohttp.ClientSession() as http, http.post(
            f"{pool.router_url}/v1/completions", headers={"X-Rollout-Class": "rlhf"},
            json={"model": pool.spec.model.served, "prompt": [1, 2], "max_tokens": 2},
        ) as resp:
            body = await resp.json()
    assert resp.status == 503 and body["error"]["code"] == "no_healthy_engine"
    assert dead in body["error"]["message"]
