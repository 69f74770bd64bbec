"""``misat up -f examples/mixed-pool.yaml``: run a RolloutPool manifest on this machine.

Starts one simulated vLLM engine per replica (or uses ``--engine-url``), the
MISA-T router configured exactly as the operator would configure it, and
prints the router's URL. Editing the manifest applies admission, workload
and budget changes live. Ctrl-C stops everything it started.

With simulated engines it prints a keep-up line every ``KEEP_UP_REPORT_S``
while they are busy (each engine's modelled time advanced / wall time x time
scale over the last 30 s, ``misat_sim.engine_loop``), flagged as a warning
when one is under 0.95: the engines then run slower than modelled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any

from rich.console import Console

from misat_router.memory import DEFAULT_MMAP_THRESHOLD_BYTES, pin_mmap_threshold
from misat_router.policy.settings import PolicyName
from misat_router.server import event_loop_factory

from .localpool import LocalPool, PoolError, keep_up_figures, local_pool, watch_manifest

KEEP_UP_REPORT_S = 30.0
"""Wall seconds between keep-up lines (the engines' recent window is as long)."""


def keep_up_status(readings: list[dict[str, Any] | None]) -> tuple[str, bool] | None:
    """The status line for these readings and whether it is a warning; None while no engine was busy."""
    from misat_sim.engine_loop import keep_up_warning

    figures = keep_up_figures(readings, "recent")
    if all(v is None for v in figures.values()):
        return None
    listed = " ".join(f"{name} {'-' if v is None else f'{v:.3f}'}" for name, v in figures.items())
    # "low": under 0.95 with enough busy time in the window to tell (the engine's own judgement).
    low = {f"engine-{i}": r.get("recent") for i, r in enumerate(readings) if r is not None and r.get("low")}
    warning = keep_up_warning(low)
    line = f"keep-up (last {KEEP_UP_REPORT_S:.0f} s busy): {listed}"
    return (f"{line}; {warning}", True) if warning else (line, False)


async def report_keep_up(pool: LocalPool, console: Console, every_s: float = KEEP_UP_REPORT_S) -> None:
    """Print the engines' keep-up every ``every_s`` while they are busy."""
    while True:
        await asyncio.sleep(every_s)  # the period of a status line, not a synchronisation
        status = keep_up_status(await pool.engine_keep_up())
        if status is not None:
            line, warn = status
            console.print(f"[bold red]warning:[/] {line}" if warn else line, highlight=False)


def admin_token_lines(router_url: str, token: str, token_file: Path | None) -> list[str]:
    """How to reach the local router's admin API: the token (or the file holding it) and an example.

    A local pool's token is printed by default: it guards a router on this
    machine only, and without it pause/resume and config pushes cannot be tried.
    With ``token_file`` the token is written there (owner-only) and only the path is printed.
    """
    if token_file is not None:
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.touch(mode=0o600, exist_ok=True)
        token_file.chmod(0o600)
        token_file.write_text(token + "\n")
        header = f'"Authorization: Bearer $(cat {token_file})"'
        first = f"Admin token written to {token_file} (mode 0600)."
    else:
        header = f'"Authorization: Bearer {token}"'
        first = f"Admin token: {token}"
    return [first, f"  e.g. curl -X POST -H {header} {router_url}/admin/pause   (then /admin/resume)"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="misat up", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-f", "--filename", type=Path, required=True, help="RolloutPool manifest (YAML)")
    ap.add_argument("--engine-url", action="append", help="a real engine's base URL (repeatable); "
                    "default: simulated engines, one per spec.engines.replicas")
    ap.add_argument("--profile", default="qwen30b-a3b-h100",
                    help="simulation profile of the engines (default qwen30b-a3b-h100)")
    ap.add_argument("--time-scale", type=float, default=10.0,
                    help="simulated engines run this many times faster than the modelled GPU (default 10)")
    ap.add_argument("--host", default="127.0.0.1", help="listen address of the router (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8080, help="router port; 0: any free port (default 8080)")
    ap.add_argument("--admin-token-file", type=Path, default=None,
                    help="write the router's admin token to this file (mode 0600) instead of printing it")
    ap.add_argument("--policy", choices=[p.value for p in PolicyName],
                    help="override spec.admission.policy (e.g. to compare with cache-aware)")
    ap.add_argument("--shards", type=int, default=None,
                    help="router shards (default: spec.router.shards); above 1, that many `misat router` "
                    "processes behind the real haproxy binary at --port, hashing X-Session-Id")
    return ap


async def serve(args: argparse.Namespace, console: Console) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with local_pool(args.filename, engine_urls=args.engine_url, profile=args.profile,
                          time_scale=args.time_scale, host=args.host, port=args.port,
                          policy=PolicyName(args.policy) if args.policy else None, shards=args.shards) as pool:
        console.print(f"[bold green]RolloutPool {pool.name!r} is up[/]: router at [bold]{pool.router_url}[/] "
                      f"(OpenAI API under /v1, status at /status), policy {pool.config.policy.name.value}, "
                      f"{len(pool.engine_urls)} engine(s): {', '.join(pool.engine_urls)}")
        for line in pool.warnings:
            console.print(f"[bold yellow]warning:[/] engine {line}", highlight=False, soft_wrap=True)
        if pool.shard_urls:
            console.print(f"{len(pool.shard_urls)} router shards behind haproxy: {', '.join(pool.shard_urls)} "
                          "(an admin call through the proxy is applied by every live shard; `misat status` "
                          "shows the whole pool)", highlight=False)
        for line in admin_token_lines(pool.router_url, pool.admin_token, args.admin_token_file):
            console.print(line, highlight=False, soft_wrap=True)
        console.print(f"Watching {args.filename} for admission changes. Ctrl-C stops everything.")
        tasks = [asyncio.create_task(watch_manifest(pool, args.filename, console.print))]
        if pool.simulated:
            tasks.append(asyncio.create_task(report_keep_up(pool, console)))
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    console.print("stopped")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=True, soft_wrap=True)
    pin_mmap_threshold(DEFAULT_MMAP_THRESHOLD_BYTES)  # as `misat router` does
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:  # the router's loop, as deployed
            runner.run(serve(args, console))
    except PoolError as exc:
        console.print(f"[bold red]misat up:[/] {exc}")
        return 1
    return 0
