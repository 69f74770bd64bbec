"""Ports and child processes for tests: ``misat_cli.processes`` plus two test-side helpers.

- ``free_port``, ``start_process``, ``stop_processes``, ``wait_http_ok``, ``ProcessStartError``:
  the product's own (``cli/processes.py``), so tests start processes exactly as ``misat up``
  and the benchmark do;
- ``running_process``: ``start_process`` whose process group is always stopped when the
  block ends, whatever the test's outcome;
- ``taken_port``: a port held bound and listening for the block (a server that must fail
  to listen there).
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from misat_cli.processes import ProcessStartError, free_port, start_process, stop_processes, wait_http_ok

__all__ = [
    "ProcessStartError",
    "free_port",
    "running_process",
    "start_process",
    "stop_processes",
    "taken_port",
    "wait_http_ok",
]

STOP_TIMEOUT_S = 5.0
"""SIGTERM grace of ``running_process`` before SIGKILL."""


@contextmanager
def running_process(
    cmd: Sequence[str],
    *,
    log_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stop_timeout_s: float = STOP_TIMEOUT_S,
) -> Iterator[subprocess.Popen[bytes]]:
    """``start_process(cmd, ...)`` for the block; its process group is stopped on exit."""
    proc = start_process(cmd, log_path=log_path, env=env, cwd=cwd)
    try:
        yield proc
    finally:
        stop_processes([proc], stop_timeout_s)


@contextmanager
def taken_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port bound and listening on ``host`` until the block ends."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        s.listen()
        yield int(s.getsockname()[1])
