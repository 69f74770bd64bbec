"""Child processes of the local tools: a free port, a start in its own session, a bounded wait
until it answers HTTP 200, and a stop of its whole process group.

Used by ``misat up`` (``localpool.py``) for its simulated engines, by the benchmark harness
for engines, routers and clients, and by the tests. A child is started in a new session, so
it leads its own process group: stopping it signals the group, which takes the grandchildren
too (a real vLLM API server forks its engine core).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import aiohttp

POLL_S = 0.1
"""Spacing of the HTTP polls of ``wait_http_ok``."""
PROBE_TIMEOUT_S = 1.0
"""Timeout of one poll of ``wait_http_ok`` (a starting server may accept and answer late)."""


class ProcessStartError(Exception):
    """A started process exited, or did not answer HTTP 200, before it was ready.

    ``returncode`` is the exit code when it exited, None when it was still running at the deadline.
    """

    def __init__(self, message: str, *, what: str, url: str, returncode: int | None) -> None:
        super().__init__(message)
        self.what = what
        self.url = url
        self.returncode = returncode


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's pick; another process may take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_process(
    cmd: Sequence[str],
    *,
    log_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new session (its own process group), stdin from /dev/null.

    stdout and stderr go to ``log_path`` (created with its folder, truncated) or to /dev/null;
    the parent's copy of the log file is closed once the child holds it. ``env`` is the
    child's whole environment, as with ``subprocess.Popen`` (None: this process's).
    """
    child_env = dict(env) if env is not None else None
    if log_path is None:
        return subprocess.Popen(
            list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            env=child_env, cwd=cwd, start_new_session=True,
        )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        return subprocess.Popen(
            list(cmd), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=child_env, cwd=cwd, start_new_session=True,
        )


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """``sig`` to the process group ``proc`` leads; to ``proc`` alone if it leads none."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        # Not a group leader (started without a new session), or the group is gone.
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
    except PermissionError:
        pass


def stop_processes(procs: Iterable[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """SIGTERM the process group of each live process, wait up to ``timeout_s`` for each, then
    SIGKILL the group of any still running and reap it. Safe on processes that already exited."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


async def wait_http_ok(url: str, proc: subprocess.Popen[bytes], timeout_s: float, *, what: str) -> None:
    """Poll ``url`` until it answers 200; ``ProcessStartError`` as soon as ``proc`` exits, or when
    ``timeout_s`` has passed. ``what`` names the process in the error ("engine at http://...")."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as http:
        while True:
            if proc.poll() is not None:
                raise ProcessStartError(f"{what} exited with code {proc.returncode} while starting",
                                        what=what, url=url, returncode=proc.returncode)
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url) as resp:
                    if resp.status == 200:
                        return
            if loop.time() > deadline:
                raise ProcessStartError(f"{what} did not become healthy in {timeout_s:g} s",
                                        what=what, url=url, returncode=None)
            await asyncio.sleep(POLL_S)  # bounded poll of a starting process
