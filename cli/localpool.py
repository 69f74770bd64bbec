"""A RolloutPool on one machine: the manifest ``kubectl apply`` takes, without Kubernetes.

The manifest is validated with the operator's models and messages, the
router config is rendered by the operator's own ``build_router_config`` (only
the engine addresses differ: local URLs instead of a headless Service), and
admission changes are pushed to the router's admin endpoint with the
operator's ``RouterClient``, the same path as the operator's hot reload.

Engines are simulated vLLM servers (``misat sim-engine``), one process each
like real replicas, or real engines given by URL. One router runs in this
process on a thread and event loop of its own (``router_thread``), so the
caller's loop cannot stall it; router shards run as processes behind HAProxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from pydantic import ValidationError

from misat_operator.models import RolloutPoolSpec, describe_spec_error, parse_spec, pool_name_error
from misat_operator.render import PoolRef, build_router_config
from misat_operator.router_client import RouterClient, RouterUnavailable
from misat_router.config import EnginesConfig, RouterConfig
from misat_router.policy.settings import PolicyName
from misat_router.server import LISTEN_BACKLOG

from .processes import ProcessStartError, free_port, start_process, stop_processes, wait_http_ok
from .router_thread import RouterThread
from .shards import ShardsError, shard_set, sharded_config

ENGINE_START_TIMEOUT_S = 60.0
"""How long a simulated engine may take to answer /health after its process starts."""
ENGINE_STOP_TIMEOUT_S = 5.0
"""SIGTERM grace before SIGKILL when stopping engines."""
MANIFEST_POLL_S = 1.0
"""How often ``misat up`` checks the manifest file for edits."""
LOCAL_NAMESPACE = "local"
KEEP_UP_PATH = "/misat/keep_up"
"""Where a simulated engine serves its keep-up (``misat_sim.server.KEEP_UP_PATH``; not imported,
so that real-engine pools need no simulator)."""
KEEP_UP_TIMEOUT_S = 2.0
SIM_ENGINE_PROBE_TIMEOUT_S = 2.0
"""Health and scrape timeout towards simulated engines: they share this machine's few cores with
the router and the trainer, so an overloaded one answers late, where a GPU server's API process
would not; the operator's tighter defaults would take it out of rotation for that."""


class PoolError(Exception):
    """A clear, user-facing reason why the local pool cannot run (no traceback wanted)."""


def _yaml_position(exc: yaml.YAMLError) -> str:
    """``:line:column`` (1-based, as editors count) of a YAML error, or nothing when unknown."""
    mark = getattr(exc, "problem_mark", None)
    return f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""


def _yaml_problem(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None)
    context = getattr(exc, "context", None)
    if problem is None:
        return str(exc)
    return f"{problem} ({context})" if context else str(problem)


def yaml_error(source: str, exc: yaml.YAMLError) -> str:
    """``source:line:column: not valid YAML: problem`` (the position where the parser knows it)."""
    return f"{source}{_yaml_position(exc)}: not valid YAML: {_yaml_problem(exc)}"


def load_manifest(path: Path) -> tuple[str, RolloutPoolSpec]:
    """Read and validate a RolloutPool manifest: (name, spec), or PoolError with the reason."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise PoolError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PoolError(yaml_error(str(path), exc)) from None
    except (RecursionError, ValueError) as exc:
        raise PoolError(f"{path}: not a usable manifest: {type(exc).__name__}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("kind") != "RolloutPool":
        kind = doc.get("kind") if isinstance(doc, dict) else None
        raise PoolError(f"{path}: not a RolloutPool manifest (kind: {kind})")
    return pool_of(doc, str(path))


def pool_of(doc: dict[str, Any], source: str) -> tuple[str, RolloutPoolSpec]:
    """A RolloutPool document's (name, spec), validated as the operator validates it; PoolError
    naming ``source`` and the manifest's paths otherwise."""
    meta = doc.get("metadata")
    name = str((meta if isinstance(meta, dict) else {}).get("name") or "")
    problem = pool_name_error(name)
    if problem:
        raise PoolError(f"{source}: invalid RolloutPool {name!r}: {problem}")
    try:
        return name, parse_spec(doc.get("spec") or {})
    except ValidationError as exc:
        raise PoolError(f"{source}: invalid RolloutPool {name!r}:\n{describe_spec_error(exc)}") from None


def render_local_config(
    name: str,
    spec: RolloutPoolSpec,
    engine_urls: list[str],
    generation: int,
    *,
    policy: PolicyName | None = None,
    length_scale: float = 1.0,
) -> RouterConfig:
    """The operator's rendering, pointed at local engines.

    With simulated engines token lengths are scaled (``length_scale``), so a
    class's footprint prior, given in real tokens, is scaled alike unless the
    manifest sets one.
    """
    ref = PoolRef(name=name, namespace=LOCAL_NAMESPACE, uid="local", generation=generation)
    config = build_router_config(spec, ref)
    policy_settings = config.policy
    if policy is not None:
        policy_settings = policy_settings.model_copy(update={"name": policy})
    mix = config.workloads
    if length_scale != 1.0:
        prior = max(1, round(policy_settings.footprint.bootstrap_tokens * length_scale))
        scaled = {"bootstrap_footprint_tokens": prior}
        mix = mix.model_copy(update={"classes": tuple(
            c if c.bootstrap_footprint_tokens is not None else c.model_copy(update=scaled) for c in mix.classes
        )})
    overrides: dict[str, Any] = {
        "engines": EnginesConfig(urls=tuple(engine_urls)).model_dump(),
        "workloads": mix.model_dump(),
        "policy": policy_settings.model_dump(),
    }
    if length_scale != 1.0:
        overrides |= {"health_timeout_s": SIM_ENGINE_PROBE_TIMEOUT_S, "scrape_timeout_s": SIM_ENGINE_PROBE_TIMEOUT_S}
    return RouterConfig.model_validate({**config.model_dump(), **overrides})


def _flatten(value: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{path}.{k}", out)
    else:
        out[path] = value


def manifest_changes(old: RolloutPoolSpec, new: RolloutPoolSpec) -> list[str]:
    """What an edit changed, as the manifest spells it: ``spec.kvBudget.fraction: 0.9 -> 0.5``."""
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    _flatten(old.model_dump(mode="json", by_alias=True, exclude_none=True), "spec", a)
    _flatten(new.model_dump(mode="json", by_alias=True, exclude_none=True), "spec", b)
    return [f"{k}: {a.get(k, '(unset)')} -> {b.get(k, '(unset)')}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]


@dataclass
class SimEngineProcess:
    url: str
    proc: subprocess.Popen[bytes]


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    try:
        await wait_http_ok(f"{url}/health", proc, timeout_s, what=f"simulated engine at {url}")
    except ProcessStartError as exc:
        raise PoolError(str(exc)) from None


async def start_sim_engines(
    spec: RolloutPoolSpec, *, profile: str, time_scale: float, host: str, log_dir: Path | None,
    num_gpu_blocks: int | None = None,
) -> list[SimEngineProcess]:
    """One ``misat sim-engine`` process per engine replica, healthy before return.

    ``num_gpu_blocks``: KV blocks per engine instead of the profile's (another GPU or model)."""
    engines: list[SimEngineProcess] = []
    try:
        for i in range(spec.engines.replicas):
            port = free_port(host)
            cmd = [sys.executable, "-P", "-m", "misat_sim.server", "--profile", profile, "--host", host,
                   "--port", str(port), "--served-model-name", spec.model.served, "--time-scale", str(time_scale),
                   "--seed", str(i), "--engine-index", str(i)]
            if spec.engines.max_num_seqs is not None:
                cmd += ["--max-num-seqs", str(spec.engines.max_num_seqs)]
            if spec.engines.max_num_batched_tokens is not None:
                cmd += ["--max-num-batched-tokens", str(spec.engines.max_num_batched_tokens)]
            if num_gpu_blocks is not None:
                cmd += ["--num-gpu-blocks", str(num_gpu_blocks)]
            log = log_dir / f"engine-{i}.log" if log_dir is not None else None
            engines.append(SimEngineProcess(f"http://{host}:{port}", start_process(cmd, log_path=log)))
        await asyncio.gather(*(_wait_healthy(e.url, e.proc, ENGINE_START_TIMEOUT_S) for e in engines))
    except BaseException:
        stop_engines(engines)
        raise
    return engines


def stop_engines(engines: list[SimEngineProcess]) -> None:
    """SIGTERM every engine's process group, then SIGKILL what is left."""
    stop_processes([e.proc for e in engines], ENGINE_STOP_TIMEOUT_S)


@dataclass
class LocalPool:
    """A running local pool."""

    name: str
    spec: RolloutPoolSpec
    router_url: str
    admin_token: str
    engine_urls: list[str]
    config: RouterConfig
    length_scale: float
    policy_override: PolicyName | None = None
    simulated: bool = False
    """Engines are this pool's simulated ones (they serve keep-up figures)."""
    warnings: list[str] = field(default_factory=list)
    """What a person should know at start (e.g. a given engine URL that does not answer)."""
    client: RouterClient = field(default_factory=RouterClient)
    shard_urls: list[str] = field(default_factory=list)
    """With router shards: each shard's own address (admin calls go to every one; router_url is the
    proxy in front of them)."""

    @property
    def admin_urls(self) -> list[str]:
        return self.shard_urls or [self.router_url]

    async def reload(self, manifest: Path) -> str:
        """Re-read the manifest and push the new admission settings (the operator's hot-reload path)."""
        name, spec = load_manifest(manifest)
        if spec.engines != self.spec.engines or spec.model != self.spec.model:
            raise PoolError("engine or model changes need a restart of `misat up` (on Kubernetes the "
                            "operator rolls the engines); admission, workload and budget changes apply live")
        if spec.router.shards != self.spec.router.shards:
            raise PoolError("a change of router.shards needs a restart of `misat up` (on Kubernetes the "
                            "operator rolls the routers)")
        config = render_local_config(name, spec, self.engine_urls, self.config.generation + 1,
                                     policy=self.policy_override, length_scale=self.length_scale)
        if self.config.shards is not None:
            config = sharded_config(config, list(self.config.shards.peers), **self.config.shards.model_dump(
                exclude={"peers"}))
        try:
            for url in self.admin_urls:
                result = await self.client.push_config(url, self.admin_token, config)
        except RouterUnavailable as exc:
            raise PoolError(f"the router refused the new settings, the old ones stay: {exc}") from None
        changes = manifest_changes(self.spec, spec)
        self.spec, self.config = spec, config
        listed = "; ".join(changes) if changes else "no setting changed"
        learned = ("the policy was rebuilt: its learned footprints and residencies start over"
                   if result.policy_rebuilt else "learned footprints and residencies kept")
        return f"applied generation {result.generation} (config {result.config_hash}): {listed}; {learned}"

    async def status(self) -> dict[str, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http, \
                http.get(f"{self.router_url}/status") as resp:
            return await resp.json()

    async def engine_keep_up(self) -> list[dict[str, Any] | None]:
        """Each simulated engine's keep-up (``/misat/keep_up``), None where it did not answer;
        empty for real engines (they have no such figure)."""
        if not self.simulated:
            return []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=KEEP_UP_TIMEOUT_S)) as http:
            return list(await asyncio.gather(*(get_keep_up(http, url) for url in self.engine_urls)))


async def get_keep_up(http: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    """A simulated engine's ``/misat/keep_up`` reading with its ``url``; None where it did not answer."""
    try:
        async with http.get(f"{url}{KEEP_UP_PATH}") as resp:
            if resp.status != 200:
                return None
            body: dict[str, Any] = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    return {"url": url, **body}


def keep_up_figures(readings: list[dict[str, Any] | None], key: str = "run") -> dict[str, float | None]:
    """``engine-i`` -> the reading's ``key`` figure (``run`` or ``recent``), None where unknown."""
    return {f"engine-{i}": (r or {}).get(key) for i, r in enumerate(readings)}


@contextlib.asynccontextmanager
async def local_pool(
    manifest: Path,
    *,
    engine_urls: list[str] | None = None,
    profile: str = "qwen30b-a3b-h100",
    time_scale: float = 10.0,
    host: str = "127.0.0.1",
    port: int = 0,
    policy: PolicyName | None = None,
    log_dir: Path | None = None,
    shards: int | None = None,
) -> AsyncIterator[LocalPool]:
    """Start engines (unless given) and the router; stop everything on exit. ``shards`` (default:
    the manifest's router.shards): above 1, that many ``misat router`` processes behind HAProxy."""
    name, spec = load_manifest(manifest)
    engines: list[SimEngineProcess] = []
    length_scale = 1.0
    if engine_urls is None:
        from misat_sim.config import SimEngineConfig

        try:
            length_scale = SimEngineConfig(profile=profile).resolve().length_scale
        except (KeyError, ValueError) as exc:
            raise PoolError(f"simulation profile {profile!r}: {exc}") from None
        engines = await start_sim_engines(spec, profile=profile, time_scale=time_scale, host=host, log_dir=log_dir)
        engine_urls = [e.url for e in engines]
        unreachable: list[str] = []
    else:
        unreachable = await unreachable_engines(engine_urls)
    router: RouterThread | None = None
    n_shards = shards if shards is not None else spec.router.shards
    try:
        config = render_local_config(name, spec, engine_urls, 1, policy=policy, length_scale=length_scale)
        token = secrets.token_urlsafe(24)
        if n_shards > 1:
            if n_shards > len(engine_urls):
                raise PoolError(f"{n_shards} router shards for {len(engine_urls)} engines: a shard owns engines, "
                                "and one without any could only hold its sessions' requests")
            workdir = log_dir / "shards" if log_dir is not None else Path(tempfile.mkdtemp(prefix="misat-shards-"))
            try:
                async with shard_set(config, n_shards, workdir, host=host, proxy_port=port,
                                     admin_token=token) as ss:
                    pool = LocalPool(name, spec, ss.proxy_url, token, engine_urls, ss.config, length_scale, policy,
                                     simulated=bool(engines), warnings=unreachable, shard_urls=ss.shard_urls)
                    try:
                        yield pool
                    finally:
                        await pool.client.close()
            except ShardsError as exc:
                raise PoolError(str(exc)) from None
            return
        # Served exactly as `misat router` serves it, on a thread and loop of its own: the
        # caller's loop (a trainer's) can neither stall it nor deafen its sockets.
        router = RouterThread(config, token)
        try:
            await router.start(host, port, backlog=LISTEN_BACKLOG)
        except OSError as exc:
            router = None  # start() closed what it had opened
            raise PoolError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        bound = router.port
        pool = LocalPool(name, spec, f"http://{host}:{bound}", token, engine_urls, config, length_scale, policy,
                         simulated=bool(engines), warnings=unreachable)
        try:
            yield pool
        finally:
            await pool.client.close()
    finally:
        if router is not None:
            await router.stop()
        stop_engines(engines)


async def unreachable_engines(urls: list[str]) -> list[str]:
    """One line per given engine whose ``/health`` does not answer 200 now (the router keeps probing it;
    requests fail fast with the reason while no engine is healthy)."""
    async def probe(http: aiohttp.ClientSession, url: str) -> str | None:
        try:
            async with http.get(f"{url}/health") as resp:
                return None if resp.status == 200 else f"{url}: /health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{url}: unreachable ({type(exc).__name__}: {exc or 'timed out'})"

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SIM_ENGINE_PROBE_TIMEOUT_S)) as http:
        found = await asyncio.gather(*(probe(http, u) for u in urls))
    return [line for line in found if line is not None]


def file_digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


async def watch_manifest(pool: LocalPool, manifest: Path, report: Callable[[str], None]) -> None:
    """Push admission edits of the manifest to the running router, as the operator would."""
    seen = file_digest(manifest)
    while True:
        await asyncio.sleep(MANIFEST_POLL_S)  # polling period of a file watch, not a synchronisation
        digest = file_digest(manifest)
        if digest is None or digest == seen:
            continue
        seen = digest
        try:
            report(f"{manifest}: {await pool.reload(manifest)}")
        except PoolError as exc:
            report(f"{manifest}: not applied: {exc}")
