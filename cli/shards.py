"""Router shards on this machine: N ``misat router`` processes behind the real ``haproxy`` binary.

``misat up --shards N`` runs a pool in this shape, the shard tests kill and
restart shards under load with it, and ``misat_bench.shard_scale`` measures
it. The proxy's configuration is the operator's own
(``misat_operator.haproxy.haproxy_config``), with the shards' loopback
addresses for servers; each shard reads the same RouterConfig with
``shards.peers`` listing every shard and gets its index with ``--shard-index``,
as a StatefulSet pod gets it from its ordinal.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from misat_operator.haproxy import ShardServer, haproxy_config
from misat_router.config import RouterConfig, ShardsConfig

from .processes import ProcessStartError, free_port, start_process, stop_processes, wait_http_ok

HAPROXY_INSTALL_HINT = (
    "install it with `bash scripts/system-packages.sh` (Debian/Ubuntu; it runs apt-get install haproxy)"
)
SHARD_START_TIMEOUT_S = 30.0
"""A shard's first /health answer (a Python start-up on a loaded machine)."""
PROXY_START_TIMEOUT_S = 15.0
"""The proxy answering /health through a shard (its first health check has to pass)."""
STOP_TIMEOUT_S = 5.0
"""SIGTERM grace of a shard or the proxy before SIGKILL (a shard drains within its drain_timeout_s)."""
SBIN_HAPROXY = Path("/usr/sbin/haproxy")
"""Where Debian installs it; a non-root PATH often lacks /usr/sbin."""


REDISPATCH = re.compile(r" \d+/\d+/\d+/\d+/\+\d+ ")


class ShardsError(Exception):
    """The shards or the proxy could not be started (the message says how to fix it)."""


def find_haproxy() -> str:
    """Path of the ``haproxy`` binary, or ShardsError saying how to install it."""
    found = shutil.which("haproxy")
    if found:
        return found
    if SBIN_HAPROXY.is_file() and os.access(SBIN_HAPROXY, os.X_OK):
        return str(SBIN_HAPROXY)
    raise ShardsError(f"router shards run behind HAProxy, and no `haproxy` binary was found: {HAPROXY_INSTALL_HINT}")


def sharded_config(config: RouterConfig, peers: list[str], **probes: float | int) -> RouterConfig:
    """``config`` with ``shards.peers`` (and any peer-probe settings given) set."""
    shards = ShardsConfig.model_validate({"peers": peers, **probes})
    return RouterConfig.model_validate({**config.model_dump(), "shards": shards.model_dump()})


@dataclass
class ShardSet:
    """N router shards and the proxy in front of them, as processes of this machine."""

    config: RouterConfig
    """The shards' config (``shards.peers`` set)."""
    ports: list[int]
    proxy_port: int
    workdir: Path
    host: str = "127.0.0.1"
    admin_token: str | None = None
    proxy_log: bool = False
    """The proxy logs one line per request to ``haproxy.log`` (retries and redispatches show there)."""
    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=list)
    proxy: subprocess.Popen[bytes] | None = None

    @property
    def proxy_url(self) -> str:
        return f"http://{self.host}:{self.proxy_port}"

    @property
    def shard_urls(self) -> list[str]:
        return [f"http://{self.host}:{p}" for p in self.ports]

    @property
    def config_path(self) -> Path:
        return self.workdir / "router.json"

    def write_config(self, config: RouterConfig) -> None:
        """Write the config every shard watches (a reload reaches all of them, as a mounted ConfigMap)."""
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(config.model_dump_json())
        tmp.replace(self.config_path)
        self.config = config

    def _shard_cmd(self, index: int) -> list[str]:
        cmd = [sys.executable, "-P", "-m", "misat_router.server", "--config", str(self.config_path),
               "--host", self.host, "--port", str(self.ports[index]), "--shard-index", str(index)]
        if self.admin_token is not None:
            cmd += ["--admin-token-file", str(self.workdir / "admin-token")]
        return cmd

    async def start_shard(self, index: int) -> None:
        """Start shard ``index`` (again, after a kill) and wait until it answers /health."""
        proc = start_process(self._shard_cmd(index), log_path=self.workdir / f"shard-{index}.log")
        self.procs[index] = proc
        try:
            await wait_http_ok(f"{self.shard_urls[index]}/health", proc, SHARD_START_TIMEOUT_S,
                               what=f"router shard {index} at {self.shard_urls[index]}")
        except ProcessStartError as exc:
            log = (self.workdir / f"shard-{index}.log").read_text(errors="replace")[-2000:]
            raise ShardsError(f"{exc}; its log ends:\n{log}") from None

    def kill_shard(self, index: int) -> None:
        """SIGKILL shard ``index`` (no drain: a crash) and reap it."""
        proc = self.procs[index]
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.procs[index] = None

    async def start(self) -> None:
        haproxy = find_haproxy()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.write_config(self.config)
        if self.admin_token is not None:
            token = self.workdir / "admin-token"
            token.touch(mode=0o600, exist_ok=True)
            token.write_text(self.admin_token + "\n")
        self.procs = [None] * len(self.ports)
        for i in range(len(self.ports)):
            await self.start_shard(i)
        cfg = haproxy_config([ShardServer(self.host, p) for p in self.ports],
                             bind_address=self.host, bind_port=self.proxy_port, dns=False,
                             log_requests=self.proxy_log)
        cfg_path = self.workdir / "haproxy.cfg"
        cfg_path.write_text(cfg)
        # -db: foreground, logs to the log file; the process group is ours to stop.
        self.proxy = start_process([haproxy, "-db", "-f", str(cfg_path)], log_path=self.workdir / "haproxy.log")
        try:
            await wait_http_ok(f"{self.proxy_url}/health", self.proxy, PROXY_START_TIMEOUT_S,
                               what=f"haproxy at {self.proxy_url}")
        except ProcessStartError as exc:
            log = (self.workdir / "haproxy.log").read_text(errors="replace")[-2000:]
            raise ShardsError(f"{exc}; its log ends:\n{log}") from None

    def redispatched(self) -> int:
        """Requests the proxy sent to another shard after a failure (from its request log)."""
        log = self.workdir / "haproxy.log"
        if not self.proxy_log or not log.exists():
            return 0
        # httplog's connection counters end in "/+N" when the request was redispatched N times.
        return sum(1 for line in log.read_text(errors="replace").splitlines() if REDISPATCH.search(line))

    def stop(self) -> None:
        procs = [p for p in [self.proxy, *self.procs] if p is not None]
        stop_processes(procs, STOP_TIMEOUT_S)


@contextlib.asynccontextmanager
async def shard_set(
    config: RouterConfig, shards: int, workdir: Path, *, host: str = "127.0.0.1", proxy_port: int = 0,
    admin_token: str | None = None, proxy_log: bool = False, **probes: float | int,
) -> AsyncIterator[ShardSet]:
    """``shards`` routers on free ports of ``host`` and the proxy on ``proxy_port`` (0: a free one)."""
    if shards < 1:
        raise ShardsError(f"--shards must be at least 1, got {shards}")
    ports = [free_port(host) for _ in range(shards)]
    peers = [f"http://{host}:{p}" for p in ports]
    s = ShardSet(sharded_config(config, peers, **probes), ports, proxy_port or free_port(host), workdir,
                 host=host, admin_token=admin_token, proxy_log=proxy_log)
    try:
        await s.start()
        yield s
    finally:
        s.stop()
