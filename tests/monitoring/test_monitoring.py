"""The monitoring files (``monitoring/``), checked with the real Prometheus and promtool binaries.

- The alert rules run in Prometheus's own rule engine: ``promtool check rules``, then
  ``promtool test rules`` with ``alerts_test.yaml`` (each alert fires on its series and stays
  silent on a near miss).
- The PodMonitors select exactly the pods the operator renders for routers, router shards and
  engines (not the shards' HAProxy), on a port those pods name, and copy the pool's and the
  component's pod labels under the names the rules and the dashboard use.
- Every dashboard query parses (promtool), and a real Prometheus scraping a live local pool
  (the router and a simulated vLLM engine, labelled as the PodMonitors label them) answers it
  with data, carrying every label its legend names.

No Kubernetes or Grafana runs here: the PodMonitors are matched against the rendered objects,
and the dashboard's JSON is read as Grafana would read its queries.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from misat_cli.localpool import LocalPool, local_pool
from misat_cli.processes import free_port, start_process, stop_processes, wait_http_ok
from misat_client import AdminClient
from misat_operator.models import parse_spec
from misat_operator.names import COMPONENT_LABEL, POOL_LABEL
from misat_operator.render import (
    ENGINE_COMPONENT,
    PROXY_COMPONENT,
    ROUTER_COMPONENT,
    SHARD_COMPONENT,
    PoolRef,
    render,
)
from tests.support.manifests import one_engine_manifest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MONITORING = ROOT / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
INSTALL_HINT = "run `bash scripts/system-packages.sh prometheus promtool` (make test does)"
RATE_WINDOW = "30s"
"""What ``$__rate_interval`` stands for here: 30 scrapes at the 1 s interval below."""
SCRAPE_INTERVAL = "1s"
WAIT_S = 60.0
"""Bound of every wait on Prometheus; a run takes a few seconds."""
MAY_BE_EMPTY = {
    "Connection failures, by engine": "misat_engine_connection_failures_total",
}
"""Panels with no series in a healthy run (nothing failed), and the family that must exist instead."""
HELD_PER_ROUND = 4


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: {INSTALL_HINT}")
    return path


def rules_spec() -> dict[str, Any]:
    doc = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert doc["kind"] == "PrometheusRule"
    spec: dict[str, Any] = doc["spec"]
    return spec


def dashboard_targets() -> Iterator[tuple[str, str, str]]:
    """(panel title, legend format, expression) of every query of the dashboard."""
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target.get("legendFormat", ""), target["expr"]


def concrete(expr: str) -> str:
    """The query as Grafana sends it with every namespace and pool selected."""
    return (expr.replace("$__rate_interval", RATE_WINDOW)
            .replace('"$namespace"', '".*"').replace('"$pool"', '".*"'))


def run_promtool(*args: str, cwd: Path) -> str:
    done = subprocess.run([tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


# ---- alert rules ------------------------------------------------------------------------


def test_alert_rules_pass_promtools_check_and_unit_tests(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules_spec()))
    shutil.copy(Path(__file__).with_name("alerts_test.yaml"), tmp_path / "alerts_test.yaml")
    assert "SUCCESS: 10 rules found" in run_promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert "SUCCESS" in run_promtool("test", "rules", "alerts_test.yaml", cwd=tmp_path)


def test_every_alert_is_unit_tested_firing() -> None:
    alerts = {r["alert"] for g in rules_spec()["groups"] for r in g["rules"]}
    tests = yaml.safe_load(Path(__file__).with_name("alerts_test.yaml").read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case.get("exp_alerts")}
    assert fired == alerts


# ---- PodMonitors ------------------------------------------------------------------------


def prometheus_label(pod_label: str) -> str:
    """The name Prometheus's Kubernetes discovery gives a pod label (non-alphanumerics -> _)."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", pod_label)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr  # the only operator the files use
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def rendered_pods(example: str) -> list[tuple[str, dict[str, str], set[str]]]:
    """(component, pod labels, container port names) of every pod template a pool renders."""
    doc = yaml.safe_load((EXAMPLES / example).read_text())
    ref = PoolRef(doc["metadata"]["name"], "rl", "uid", 1)
    pods = []
    for obj in render(parse_spec(doc["spec"]), ref, "token").objects():
        template = obj.get("spec", {}).get("template")
        if template is None:
            continue
        labels = template["metadata"]["labels"]
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        pods.append((labels[COMPONENT_LABEL], labels, ports))
    return pods


@pytest.mark.parametrize("example", ["mixed-pool.yaml", "sharded-pool.yaml"])
def test_podmonitors_select_the_pools_routers_and_engines_and_nothing_else(example: str) -> None:
    monitors = {m["metadata"]["name"]: m["spec"] for m in yaml.safe_load_all((MONITORING / "podmonitors.yaml").read_text())}
    wanted = {"misat-routers": {ROUTER_COMPONENT, SHARD_COMPONENT}, "misat-engines": {ENGINE_COMPONENT}}
    assert set(monitors) == set(wanted)
    pods = rendered_pods(example)
    assert {c for c, _, _ in pods} >= {ROUTER_COMPONENT, ENGINE_COMPONENT}
    if example == "sharded-pool.yaml":
        assert {SHARD_COMPONENT, PROXY_COMPONENT} <= {c for c, _, _ in pods}
    for name, spec in monitors.items():
        matched = {c for c, labels, _ in pods if selects(spec["selector"], labels)}
        assert matched == wanted[name] & {c for c, _, _ in pods}, name
        [endpoint] = spec["podMetricsEndpoints"]
        assert endpoint["path"] == "/metrics"
        for component, labels, ports in pods:
            if selects(spec["selector"], labels):
                assert endpoint["port"] in ports, (name, component, ports)
        relabels = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
        assert relabels == {"pool": [prometheus_label(POOL_LABEL)], "component": [prometheus_label(COMPONENT_LABEL)]}


def relabel(rules: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus's relabelling, for the actions the scrape job uses (keep, replace); None: dropped.
    (Debian's Prometheus is built without Kubernetes discovery, so `promtool check config`
    cannot read that job: its rules are applied here to the rendered pods instead.)"""
    out = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(out.get(name, "") for name in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep":
            if match is None:
                return None
        elif action == "replace":
            if match is not None:
                out[rule["target_label"]] = match.expand(rule.get("replacement", "$1").replace("$1", r"\1"))
        else:
            raise AssertionError(f"relabel action {action} is not modelled here")
    return out


@pytest.mark.parametrize("example", ["mixed-pool.yaml", "sharded-pool.yaml"])
def test_the_plain_scrape_job_keeps_the_same_pods_with_the_same_labels(example: str) -> None:
    [job] = yaml.safe_load((MONITORING / "prometheus-scrape.yaml").read_text())["scrape_configs"]
    assert [sd["role"] for sd in job["kubernetes_sd_configs"]] == ["pod"]
    pool = yaml.safe_load((EXAMPLES / example).read_text())["metadata"]["name"]
    kept = []
    for i, (component, labels, ports) in enumerate(rendered_pods(example)):
        meta = {prometheus_label(k): v for k, v in labels.items()}
        meta |= {"__meta_kubernetes_namespace": "rl", "__meta_kubernetes_pod_name": f"pod-{i}"}
        for port in ports:
            target = relabel(job["relabel_configs"], {**meta, "__meta_kubernetes_pod_container_port_name": port})
            if target is not None:
                kept.append(component)
                assert target["pool"] == pool and target["component"] == component
                assert target["namespace"] == "rl" and target["pod"] == f"pod-{i}"
    wanted = {ROUTER_COMPONENT, SHARD_COMPONENT, ENGINE_COMPONENT}
    assert sorted(kept) == sorted(c for c, _, _ in rendered_pods(example) if c in wanted)


# ---- the dashboard ----------------------------------------------------------------------


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    targets = list(dashboard_targets())
    assert len(targets) >= 20
    rules = [{"record": f"dashboard:query_{i}", "expr": concrete(expr)} for i, (_, _, expr) in enumerate(targets)]
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in run_promtool("check", "rules", "queries.yaml", cwd=tmp_path)


def exposed_families(text: str) -> set[str]:
    """Sample names a /metrics page can carry, from its TYPE lines (histograms: their series)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            if kind == "counter" and not name.endswith("_total"):
                names.add(f"{name}_total")
    return names


class Prometheus:
    """A real Prometheus server scraping the pool every second, its series labelled as the
    PodMonitors label them."""

    def __init__(self, pool: LocalPool, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        common = {"namespace": "local", "pool": pool.name}
        jobs = [("misat-routers", pool.router_url, {**common, "component": ROUTER_COMPONENT, "pod": "router-0"})]
        jobs += [("misat-engines", url, {**common, "component": ENGINE_COMPONENT, "pod": f"engines-{i}"})
                 for i, url in enumerate(pool.engine_urls)]
        config = {
            "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": [
                {"job_name": f"{job}-{i}", "static_configs": [{"targets": [url.removeprefix("http://")], "labels": labels}]}
                for i, (job, url, labels) in enumerate(jobs)
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        self.proc = start_process(
            [tool("prometheus"), f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            log_path=self.workdir / "prometheus.log")
        await wait_http_ok(f"{self.url}/-/ready", self.proc, WAIT_S, what=f"prometheus at {self.url}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_processes([self.proc], 5.0)

    async def query(self, http: aiohttp.ClientSession, expr: str) -> list[dict[str, Any]]:
        async with http.get(f"{self.url}/api/v1/query", params={"query": expr}) as resp:
            body = await resp.json()
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def wait_for(self, http: aiohttp.ClientSession, expr: str, what: str) -> None:
        """Until ``expr`` has a result: polling the server's answer, bounded by WAIT_S."""
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while not await self.query(http, expr):
            if asyncio.get_running_loop().time() > deadline:
                pytest.fail(f"prometheus never saw {what} ({expr}); its log: {self.workdir / 'prometheus.log'}")
            await asyncio.sleep(0.2)  # the scrape interval is 1 s: a poll period, not a synchronisation


@pytest.fixture
async def scraped_pool(tmp_path: Path) -> AsyncIterator[tuple[LocalPool, Prometheus]]:
    manifest = one_engine_manifest(tmp_path, policy="misa-t")  # misa-t: the class KV budgets too
    async with local_pool(manifest, time_scale=200.0) as pool:
        prom = Prometheus(pool, tmp_path)
        try:
            await prom.start()
            yield pool, prom
        finally:
            prom.stop()


async def drive(pool: LocalPool, prom: Prometheus, http: aiohttp.ClientSession) -> int:
    """Requests of every class (agentic sessions of two turns), two rounds of them held by a
    pause and released; returns how many requests completed."""
    model = pool.spec.model.served

    async def one(cls: str, n: int, headers: dict[str, str] | None = None) -> None:
        async with http.post(f"{pool.router_url}/v1/completions", headers={"X-Rollout-Class": cls, **(headers or {})},
                             json={"model": model, "prompt": [7 + n % 50, 8, 9, 10] * 8, "max_tokens": 8}) as resp:
            assert resp.status == 200, await resp.text()

    async def agentic(n: int) -> None:
        for turn in (0, 1):
            await one("agentic", n, {"X-Session-Id": f"s{n}", "X-Session-Turn": str(turn),
                                     "X-Session-End": "true" if turn else "false"})

    async def held_round(admin: AdminClient, first: int) -> None:
        await admin.pause()
        held = [asyncio.create_task(one("rlvr", first + n)) for n in range(HELD_PER_ROUND)]
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while (await admin.status()).held_requests < len(held):
            assert asyncio.get_running_loop().time() < deadline, "the paused router never held the requests"
            await asyncio.sleep(0.05)
        await admin.resume()
        await asyncio.gather(*held)

    async with AdminClient(pool.router_url, pool.admin_token) as admin:
        # A labelled series appears with its first observation, and a rate needs a scrape
        # before an increase: the first round makes the hold-wait series, the second moves it.
        await held_round(admin, 0)
        await prom.wait_for(http, 'misat_hold_wait_seconds_count{class="rlvr"}', "the first holds")
        await held_round(admin, HELD_PER_ROUND)
    await asyncio.gather(*(one(cls, n) for cls in ("rlvr", "rlhf") for n in range(6)), *(agentic(n) for n in range(4)))
    return 2 * HELD_PER_ROUND + 12 + 8


async def test_every_dashboard_panel_shows_data_from_a_live_pool(scraped_pool: tuple[LocalPool, Prometheus],
                                                                 tmp_path: Path) -> None:
    pool, prom = scraped_pool
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        await prom.wait_for(http, 'up{component="router"} == 1', "the router up")
        await prom.wait_for(http, 'up{component="engine"} == 1', "the engine up")
        completed = await drive(pool, prom, http)
        edited = yaml.safe_load((tmp_path / "pool.yaml").read_text())
        edited["spec"]["kvBudget"]["fraction"] = 0.8
        (tmp_path / "pool.yaml").write_text(yaml.safe_dump(edited))
        await pool.reload(tmp_path / "pool.yaml")  # a config reload for its panel
        await prom.wait_for(http, f'sum(misat_requests_total{{outcome="ok"}}) >= {completed}', "every request")
        await prom.wait_for(http, "misat_config_reloads_total", "the reload")
        # Two more scrapes after the last event, so that each rate window holds the change.
        await prom.wait_for(http, "count_over_time(misat_config_reloads_total[30s]) >= 3", "scrapes after the reload")

        async with http.get(f"{pool.router_url}/metrics") as resp:
            families = exposed_families(await resp.text())
        async with http.get(f"{pool.engine_urls[0]}/metrics") as resp:
            families |= exposed_families(await resp.text())

        problems = []
        for title, legend, expr in dashboard_targets():
            for name in re.findall(r"\b(?:misat_|vllm:)[a-zA-Z0-9_:]*", expr):
                if name not in families:
                    problems.append(f"{title}: {name} is exposed by neither the router nor the engine")
            result = await prom.query(http, concrete(expr))
            if title in MAY_BE_EMPTY:
                assert MAY_BE_EMPTY[title] in families
                continue
            values = [float(r["value"][1]) for r in result]
            if not any(math.isfinite(v) for v in values):
                problems.append(f"{title}: {concrete(expr)} gave {result or 'no series'}")
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
                missing = [r["metric"] for r in result if not r["metric"].get(label)]
                if missing:
                    problems.append(f"{title}: legend {legend!r} names {label}, missing from {missing}")
        assert not problems, "\n".join(problems)
