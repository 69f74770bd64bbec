"""Router shards, measured: one shard's requests/s and CPU per request, HAProxy's own cost per
request, and what they give for 2, 4 and 8 shards (docs/scale.md, "Router shards").

``python -P -m misat_bench.shard_scale`` runs, on instant stub engines (the proxy benchmark's
nginx stubs, ``misat_bench.proxy_bench``), one router shard behind the real ``haproxy``
(``misat_cli.shards``, as ``misat up --shards`` runs it) and drives it with ``wrk``, each
request carrying one of ``sessions`` session ids (``X-Session-Id``, the header the proxy
hashes). Per round, interleaved:

- ``shard direct``: wrk -> the shard (its requests/s, and its CPU seconds per request);
- ``through haproxy``: wrk -> haproxy -> the shard (the same, plus haproxy's own CPU seconds
  per request, read from ``/proc/<pid>/stat`` before and after).

On a 2-core machine wrk, the proxy, the shard and nginx share the CPUs, so N shards cannot be
run side by side to measure scale-out; the 2/4/8-shard figures are computed, and labelled so:
N shards, each on its own core, serve N / (shard CPU per request) requests/s (sessions hash
evenly; each shard admits on its own engines, so shards share no state on the request path),
and the proxy needs that rate x its CPU per request in cores.

Output: ``out/shard_scale/result.json`` and ``result.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from misat_bench.proxy_bench import (
    WARMUP_S,
    ProxyBenchSettings,
    WrkResult,
    cpu_seconds,
    misat_config,
    prompts,
    request_body,
    run_wrk,
    stub_engines,
)
from misat_cli.shards import shard_set
from misat_router.config import RouterConfig
from misat_router.policy.settings import PolicyName

RESULT_LINE = "PROXYBENCH "
"""The wrk script's result prefix (``proxy_bench.parse_wrk_output`` reads it)."""
SCALE_OUT = (2, 4, 8)
"""Shard counts the computed figures are given for."""


class ShardScaleSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    rounds: int = Field(3, ge=1, description="interleaved rounds (median, min, max)")
    duration_s: float = Field(8.0, gt=0, description="seconds of load per target per round")
    connections: int = Field(32, ge=1, description="wrk connections")
    prompt_tokens: int = Field(512, ge=1, description="token ids per prompt")
    prompts: int = Field(64, ge=1, description="distinct prompts the load cycles over")
    sessions: int = Field(256, ge=1, description="distinct session ids the load cycles over")
    policy: PolicyName = Field(PolicyName.MISA_T, description="the shard's policy")
    seed: int = 0


def wrk_session_script(bodies: list[bytes], sessions: int) -> str:
    """Requests in turn, each with the next of ``sessions`` session ids; one JSON result line."""
    literals = ",\n".join("[[" + b.decode() + "]]" for b in bodies)
    return f"""local bodies = {{
{literals}
}}
local i = 0
function request()
  i = i + 1
  local h = {{["Content-Type"] = "application/json", ["X-Session-Id"] = "s" .. (i % {sessions})}}
  return wrk.format("POST", "/v1/completions", h, bodies[(i % #bodies) + 1])
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{RESULT_LINE}{{"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,"status":%d,'
    .. '"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d}}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99)))
end
"""


class Run(BaseModel):
    target: str
    round: int
    requests_per_s: float
    errors: int
    p50_ms: float
    shard_cpu_ms_per_request: float
    proxy_cpu_ms_per_request: float | None


class Figures(BaseModel):
    settings: ShardScaleSettings
    runs: list[Run]
    shard_requests_per_s: float = Field(description="median, direct")
    shard_cpu_ms_per_request: float = Field(description="median, direct")
    proxied_requests_per_s: float = Field(description="median, through haproxy")
    proxy_cpu_ms_per_request: float = Field(description="median: haproxy's own CPU per request")
    scale_out: dict[int, dict[str, float]] = Field(description="computed: N -> requests/s and proxy cores")


async def measure_once(url: str, script: Path, s: ShardScaleSettings, shard_pid: int,
                       proxy_pid: int | None) -> tuple[WrkResult, float, float | None]:
    shard0, proxy0 = cpu_seconds(shard_pid), cpu_seconds(proxy_pid) if proxy_pid else 0.0
    result = await run_wrk(url, script, s.connections, 1, s.duration_s)
    n = max(1, result.requests)
    shard_ms = 1000.0 * (cpu_seconds(shard_pid) - shard0) / n
    proxy_ms = 1000.0 * (cpu_seconds(proxy_pid) - proxy0) / n if proxy_pid else None
    return result, shard_ms, proxy_ms


async def run(s: ShardScaleSettings, out_dir: Path) -> Figures:
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="misat-shard-scale-"))
    script = work / "load.lua"
    bodies = [request_body(p) for p in prompts(s.prompts, s.prompt_tokens, s.seed)]
    script.write_text(wrk_session_script(bodies, s.sessions))
    stub_settings = ProxyBenchSettings(prompt_tokens=s.prompt_tokens)
    runs: list[Run] = []
    with stub_engines(stub_settings, work, out_dir) as urls:
        config = RouterConfig.model_validate(misat_config(urls, s.policy.value))
        async with shard_set(config, 1, work / "shards") as shards:
            shard = shards.procs[0]
            assert shard is not None and shards.proxy is not None
            targets = [("shard direct", shards.shard_urls[0], None), ("through haproxy", shards.proxy_url,
                                                                       shards.proxy.pid)]
            for _, url, _ in targets:  # warm-up, unmeasured
                await run_wrk(url, script, s.connections, 1, WARMUP_S)
            for r in range(s.rounds):
                for name, url, proxy_pid in targets:
                    result, shard_ms, proxy_ms = await measure_once(url, script, s, shard.pid, proxy_pid)
                    runs.append(Run(target=name, round=r, requests_per_s=result.requests_per_s, errors=result.errors,
                                    p50_ms=result.p50_us / 1000.0, shard_cpu_ms_per_request=shard_ms,
                                    proxy_cpu_ms_per_request=proxy_ms))

    def med(target: str, field: str) -> float:
        return statistics.median(float(getattr(x, field)) for x in runs if x.target == target)

    shard_ms = med("shard direct", "shard_cpu_ms_per_request")
    proxy_ms = med("through haproxy", "proxy_cpu_ms_per_request")
    per_shard = 1000.0 / shard_ms  # one core busy with one shard
    scale = {n: {"requests_per_s": n * per_shard, "proxy_cores": n * per_shard * proxy_ms / 1000.0}
             for n in SCALE_OUT}
    figures = Figures(settings=s, runs=runs, shard_requests_per_s=med("shard direct", "requests_per_s"),
                      shard_cpu_ms_per_request=shard_ms,
                      proxied_requests_per_s=med("through haproxy", "requests_per_s"),
                      proxy_cpu_ms_per_request=proxy_ms, scale_out=scale)
    (out_dir / "result.json").write_text(figures.model_dump_json(indent=2))
    (out_dir / "result.md").write_text(markdown(figures))
    return figures


def markdown(f: Figures) -> str:
    lines = [
        "| target | requests/s (median) | shard CPU ms/request | haproxy CPU ms/request | errors |",
        "|---|---:|---:|---:|---:|",
    ]
    for target in ("shard direct", "through haproxy"):
        rs = [x for x in f.runs if x.target == target]
        proxy = [x.proxy_cpu_ms_per_request for x in rs if x.proxy_cpu_ms_per_request is not None]
        lines.append(
            f"| {target} | {statistics.median(x.requests_per_s for x in rs):.0f} | "
            f"{statistics.median(x.shard_cpu_ms_per_request for x in rs):.3f} | "
            f"{(f'{statistics.median(proxy):.3f}' if proxy else '-')} | {sum(x.errors for x in rs)} |"
        )
    lines += ["", "Computed from the measured CPU per request (each shard on its own core):", "",
              "| shards | requests/s | haproxy cores needed |", "|---:|---:|---:|"]
    for n, v in f.scale_out.items():
        lines.append(f"| {n} | {v['requests_per_s']:.0f} | {v['proxy_cores']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -P -m misat_bench.shard_scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, field in ShardScaleSettings.model_fields.items():
        if name == "policy":
            ap.add_argument("--policy", default=field.default.value, choices=[p.value for p in PolicyName])
            continue
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(field.default), default=field.default,
                        help=field.description)
    ap.add_argument("--out", type=Path, default=Path("out/shard_scale"))
    args = ap.parse_args(argv)
    s = ShardScaleSettings.model_validate({k: getattr(args, k) for k in ShardScaleSettings.model_fields})
    figures = asyncio.run(run(s, args.out))
    print(markdown(figures))
    print(json.dumps({"out": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
