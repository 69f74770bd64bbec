"""``misat status [URL]``: a running router's ``/status``, as tables a person reads.

Through the proxy of a sharded pool (``misat up --shards N``) it shows the whole
pool, combined by the shard that answers from every live shard's view
(``/status?scope=pool``), with a line saying which shards answered; ``--shard``
shows only the answering shard's view.

Shares are percent, as in the RolloutPool manifest; KV figures from the
policy's footprint estimates are labelled as estimates, and the engines'
own measured KV use sits beside them. The rendering is pure (a dict in,
rich renderables out) so it is tested on a live router's real ``/status``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from rich.console import Console, Group, RenderableType
from rich.table import Table

DEFAULT_URL = "http://127.0.0.1:8080"
"""Where ``misat up`` serves its router by default."""
TIMEOUT_S = 5.0
PIPE_WIDTH = 200
"""Columns when stdout is not a terminal."""


def _pct(v: object, digits: int = 1) -> str:
    return f"{100 * v:.{digits}f}%" if isinstance(v, int | float) and not isinstance(v, bool) else "-"


def _tokens(v: object) -> str:
    return f"{v:,.0f}" if isinstance(v, int | float) and not isinstance(v, bool) else "-"


def _text(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def summary(status: Mapping[str, Any]) -> Table:
    grid = Table.grid(padding=(0, 2))
    engines = status.get("engines") or []
    state = "paused" if status.get("paused") else ("ready" if status.get("ready") else "not ready")
    if status.get("paused") and status.get("pause_mode"):
        state += f" ({status['pause_mode']})"
    if status.get("draining"):
        state += ", draining"
    grid.add_row("[bold]router[/]", f"policy [bold]{_text(status.get('policy'))}[/]",
                 f"generation {_text(status.get('generation'))} (config {_text(status.get('config_hash'))})",
                 f"model {_text(status.get('model'))}", state)
    grid.add_row("", f"engines healthy {_text(status.get('healthy_engines'))}/{len(engines)}",
                 f"requests in flight {_text(status.get('requests_in_flight'))}",
                 f"held {_text(status.get('held_requests'))}",
                 f"samples/min {status.get('sample_rate_per_min', 0):.1f}")
    if status.get("held_requests"):
        reasons = ", ".join(f"{k} {v}" for k, v in sorted((status.get("held_by_reason") or {}).items()))
        oldest = status.get("oldest_hold_s")
        grid.add_row("[bold]held[/]", reasons or "-", f"oldest held {oldest:.1f} s" if oldest is not None else "",
                     "", "")
    grid.add_row("", f"prefix hit {_pct(status.get('prefix_hit_rate'))}",
                 f"mixture TV {status.get('mixture_tv_points', 0):.2f} pts",
                 f"sessions ended idle {_text(status.get('sessions_ended_idle'))}", "")
    if status.get("last_reload_error"):
        grid.add_row("[bold red]last rejected config[/]", str(status["last_reload_error"]), "", "", "")
    shards = status.get("shards")
    if isinstance(shards, dict) and shards:
        grid.add_row("[bold]shards[/]", "; ".join(f"{i}: {v}" for i, v in shards.items()), "", "", "")
    elif isinstance(status.get("shard"), dict):
        sh = status["shard"]
        grid.add_row("[bold]shard[/]", f"{_text(sh.get('index'))} of {_text(sh.get('count'))}: this shard's "
                     "view only", f"live shards {_text(sh.get('live'))}", "", "")
    return grid


def classes_table(status: Mapping[str, Any]) -> Table:
    t = Table(title="workload classes")
    for col in ("class", "target %", "consumed %", "completed units", "active sessions", "held requests",
                "KV budget (est. tokens)", "KV in use (est. tokens)"):
        t.add_column(col, justify="left" if col == "class" else "right")
    for c in status.get("classes") or []:
        t.add_row(_text(c.get("name")), _pct(c.get("target_share")), _pct(c.get("consumed_share")),
                  _text(c.get("completed_units")), _text(c.get("active_sessions")), _text(c.get("held_requests")),
                  _tokens(c.get("kv_budget_tokens")), _tokens(c.get("kv_used_tokens")))
    return t


def engines_table(status: Mapping[str, Any]) -> Table:
    t = Table(title="engines (KV use and hits as the engines measure them)")
    rows = status.get("engines") or []
    extra = [k for k in ("weight_version",) if any(k in e for e in rows)]
    # Only while some engine is frozen (a keep pause) or held (start-up weights after a restart or a
    # join: the why is long).
    extra += [k for k in ("frozen",) if any(e.get(k) for e in rows)]
    extra += [k for k in ("held",) if any(e.get(k) is not None for e in rows)]
    headers = {"weight_version": "weight version", "frozen": "frozen (keep pause)", "held": "held (no new work)"}
    for col in ("engine", "healthy", "draining", "sessions", "in flight", "running", "waiting", "KV in use",
                "KV capacity (tokens)", "prefix hit", "preemptions", "last scrape", "last error",
                *(headers[k] for k in extra)):
        # The engine's URL is what a person looks for: never cut it.
        t.add_column(col, justify="left" if col in ("engine", "last error") else "right", no_wrap=col == "engine")
    for e in rows:
        age = e.get("last_scrape_age_s")
        # An engine this shard hands back to a returning peer drains like one the config drains.
        draining = "handing back" if e.get("handing_back") else _text(e.get("draining"))
        t.add_row(_text(e.get("id")), _text(e.get("healthy")), draining, _text(e.get("sessions")),
                  _text(e.get("in_flight")), _text(e.get("running")), _text(e.get("waiting")),
                  _pct(e.get("kv_usage")), _tokens(e.get("kv_capacity_tokens")), _pct(e.get("prefix_hit_rate")),
                  _tokens(e.get("preemptions_total")), "-" if age is None else f"{age:.1f} s ago",
                  _text(e.get("last_error")), *(_text(e.get(k)) for k in extra))
    return t


def kv_table(status: Mapping[str, Any]) -> Table | None:
    rows: Sequence[Mapping[str, Any]] = status.get("kv") or []
    if not rows:
        return None
    t = Table(title="KV allocation per engine and class (policy estimates: footprint x sessions)")
    for col in ("engine", "class", "sessions", "cap (sessions)", "budget (est. tokens)", "in use (est. tokens)",
                "why this budget and cap"):
        t.add_column(col, justify="left" if col in ("engine", "class", "why this budget and cap") else "right")
    for r in rows:
        t.add_row(_text(r.get("engine")), _text(r.get("workload_class")), _text(r.get("sessions")),
                  _text(r.get("cap")), _tokens(r.get("budget_tokens")), _tokens(r.get("used_tokens")),
                  _text(r.get("reason")))
    return t


def render_status(status: Mapping[str, Any]) -> RenderableType:
    """Every table for one ``/status`` body."""
    parts: list[RenderableType] = [summary(status), classes_table(status), engines_table(status)]
    kv = kv_table(status)
    if kv is not None:
        parts.append(kv)
    return Group(*parts)


async def fetch_status(url: str, scope: str = "pool") -> dict[str, Any]:
    """``/status`` of the router at ``url``: the pool's view (``pool``; an unsharded router's own)
    or only the answering shard's (``shard``)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as http, \
            http.get(url.rstrip("/") + "/status", params={"scope": scope}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}/status answered {resp.status}: {(await resp.text())[:300]}")
        body: dict[str, Any] = await resp.json()
        return body


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="misat status", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url", nargs="?", default=DEFAULT_URL, help=f"the router's base URL (default {DEFAULT_URL})")
    ap.add_argument("--shard", action="store_true",
                    help="a sharded pool: only the view of the shard that answers, not the whole pool's")
    return ap


def main(argv: list[str] | None = None) -> int:
    import asyncio

    args = build_parser().parse_args(argv)
    # Wide enough for the engines table when output is a pipe or a log (rich assumes 80 there).
    console = Console() if sys.stdout.isatty() else Console(width=PIPE_WIDTH)
    try:
        status = asyncio.run(fetch_status(args.url, "shard" if args.shard else "pool"))
    except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
        print(f"misat status: cannot read {args.url}/status: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    console.print(render_status(status))
    return 0
