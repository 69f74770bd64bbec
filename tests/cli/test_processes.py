"""``misat_cli.processes``: real children started in their own session, stopped by process group.

Readiness and exit are observed through the child's own output: its log is a FIFO the test
reads, so "the child has installed its handler" is a line the test waits for, and "every
process of the group is gone" is the FIFO's end of file (each of them held it open as its
stdout). Every wait is bounded; none is a sleep.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from misat_cli.processes import ProcessStartError, free_port, start_process, stop_processes, wait_http_ok
from tests.support.processes import running_process

WAIT_S = 30.0
"""Bound of every wait here; a healthy run takes a fraction of a second."""

PAUSE = "import signal; signal.pause()"
SERVE = (
    "import http.server, sys\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()\n"
)
"""A child answering 200 (the listing of its working directory) at ``/`` on the given port."""


class FifoLog:
    """The read end of a FIFO given to a child as its log (stdout and stderr)."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path
        # Non-blocking open: succeeds with no writer yet, so start_process's open for writing
        # then finds a reader and does not block.
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.data = b""

    def _read(self, deadline: float) -> bool:
        """Read what is there (waiting until something is); False at end of file."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"nothing more from the child within {WAIT_S} s; got {self.data!r}")
        readable, _, _ = select.select([self.fd], [], [], remaining)
        if not readable:
            return True
        chunk = os.read(self.fd, 65536)
        self.data += chunk
        return bool(chunk)

    def wait_for(self, *needles: bytes) -> None:
        deadline = time.monotonic() + WAIT_S
        while not all(n in self.data for n in needles):
            if not self._read(deadline):
                raise AssertionError(f"the child's output ended without {needles}: {self.data!r}")

    def wait_closed(self) -> None:
        """Until every writer (each process that inherited the log) has exited."""
        deadline = time.monotonic() + WAIT_S
        while self._read(deadline):
            pass

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def fifo_log(tmp_path: Path) -> Iterator[FifoLog]:
    log = FifoLog(tmp_path / "child.log")
    yield log
    log.close()


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-P", "-c", code, *args]


def test_free_port_can_be_bound_and_listened_on() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert s.getsockname()[1] == port


def test_start_process_own_session_devnull_stdin_log_env_cwd(tmp_path: Path) -> None:
    code = ("import os, sys\n"
            "print('sid-is-pid', os.getsid(0) == os.getpid())\n"
            "print('stdin', repr(sys.stdin.read()))\n"
            "print('env', os.environ.get('MISAT_PROBE'), 'PATH' in os.environ)\n"
            "print('cwd', os.getcwd())\n"
            "print('to stderr', file=sys.stderr)\n")
    log = tmp_path / "logs" / "child.log"  # its folder is created
    proc = start_process(python(code), log_path=log, env={"MISAT_PROBE": "yes"}, cwd=tmp_path)
    assert proc.wait(timeout=WAIT_S) == 0
    lines = log.read_text().splitlines()
    assert "sid-is-pid True" in lines
    assert "stdin ''" in lines
    assert "env yes False" in lines  # env is the whole environment: no PATH was passed
    assert f"cwd {tmp_path}" in lines
    assert "to stderr" in lines


def test_stop_sigterms_the_whole_process_group(fifo_log: FifoLog) -> None:
    # The child starts a grandchild in its group (as vLLM's API server starts its engine core);
    # both print when running and hold the log open until they die.
    code = ("import signal, subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-P', '-c', \"print('grandchild up', flush=True); {PAUSE}\"])\n"
            "print('child up', flush=True)\n"
            "signal.pause()\n")
    proc = start_process(python(code), log_path=fifo_log.path)
    try:
        fifo_log.wait_for(b"child up", b"grandchild up")
        stop_processes([proc], timeout_s=WAIT_S)
        assert proc.returncode == -signal.SIGTERM
        fifo_log.wait_closed()  # the grandchild is gone too: the group was signalled
    finally:
        stop_processes([proc], timeout_s=1.0)


def test_a_child_ignoring_sigterm_is_killed_after_the_grace(fifo_log: FifoLog) -> None:
    code = f"import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ignoring', flush=True); {PAUSE}"
    proc = start_process(python(code), log_path=fifo_log.path)
    try:
        fifo_log.wait_for(b"ignoring")
        t0 = time.monotonic()
        stop_processes([proc], timeout_s=0.3)
        assert proc.returncode == -signal.SIGKILL
        assert time.monotonic() - t0 < WAIT_S
        fifo_log.wait_closed()
    finally:
        stop_processes([proc], timeout_s=1.0)


def test_stop_is_safe_on_exited_processes_and_on_ones_without_their_own_group() -> None:
    done = start_process(python("pass"))
    assert done.wait(timeout=WAIT_S) == 0
    # Started by plain Popen: in this process's group, so only the process itself is signalled.
    plain = subprocess.Popen(python(PAUSE), stdin=subprocess.DEVNULL)
    try:
        stop_processes([done, plain], timeout_s=WAIT_S)
        assert done.returncode == 0 and plain.returncode == -signal.SIGTERM
    finally:
        if plain.poll() is None:
            plain.kill()
            plain.wait()


async def test_wait_http_ok_returns_once_the_child_answers(tmp_path: Path) -> None:
    port = free_port()
    with running_process(python(SERVE, str(port)), cwd=tmp_path) as proc:
        await wait_http_ok(f"http://127.0.0.1:{port}/", proc, WAIT_S, what="test server")
        assert proc.poll() is None


async def test_wait_http_ok_fails_fast_when_the_child_exits() -> None:
    url = f"http://127.0.0.1:{free_port()}/health"  # nothing listens there
    with running_process(python("import sys; sys.exit(3)")) as proc:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ProcessStartError, match=r"^test server exited with code 3 while starting$") as err:
            await wait_http_ok(url, proc, 10 * WAIT_S, what="test server")
        assert asyncio.get_running_loop().time() - t0 < WAIT_S  # not the whole timeout
    assert (err.value.what, err.value.url, err.value.returncode) == ("test server", url, 3)


async def test_wait_http_ok_gives_up_at_the_deadline() -> None:
    url = f"http://127.0.0.1:{free_port()}/health"
    with running_process(python(PAUSE)) as proc:
        with pytest.raises(ProcessStartError, match=r"^quiet server did not become healthy in 0.3 s$") as err:
            await wait_http_ok(url, proc, 0.3, what="quiet server")
        assert err.value.returncode is None and proc.poll() is None
