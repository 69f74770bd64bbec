"""Hot reload: apply a new RouterConfig atomically, from ``PUT /admin/config`` or a watched file.

``apply_config`` is synchronous, so it runs between two decisions of the one
event loop: no request ever sees half a config. What a reload keeps and what
it changes:

- **Always kept**: the HOLD ledger (held requests, in arrival order),
  requests in flight and their streams, the runner's sessions, the consumed
  mixture counts, engine health and metrics.
- **Workloads changed, policy settings not**: ``runner.set_mix`` retargets the
  mixture and tells the policy (which keeps what it learned).
- **Policy settings or name changed**: a new policy is built and the live
  work is re-registered with it: held requests (``on_hold``), in-flight
  requests (``on_placed``), idle multi-turn sessions (a zero-token
  ``on_placed`` + ``on_finished`` on their engine, so they keep counting
  against caps), and the latest engine snapshots (``on_metrics``). What the
  old policy had *learned* (footprint and residency estimates, hit-rate
  history, prefix index beyond in-flight prompts) starts afresh.
- **Engines changed**: static URLs apply at once; a Service is re-resolved at
  once. Removed engines leave rotation; their in-flight requests finish.
- Timeouts, intervals and limits are read per use, so they apply at once;
  ``upstream_max_connections`` and ``upstream_keepalive_s`` only at the
  next start.

Refused, with the old config kept: an invalid document (400, the reason names
the path), a lower generation than the applied one (409, stale), or a config
that drops a class that still has live sessions or held requests (400).
The same config (same hash) is a no-op.

The watched file is re-read every ``config_poll_interval_s`` and compared by
content hash, which also covers a ConfigMap's ``..data`` symlink swap (the
path resolves to the new target; mtimes of the swapped files are not relied on).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ConfigError, RouterConfig, parse_config
from .errors import ConfigRejected, RouterError, StaleConfig

if TYPE_CHECKING:
    from .app import RouterState

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class ReloadResult:
    applied: bool
    generation: int
    config_hash: str
    changes: tuple[str, ...]
    policy_rebuilt: bool = False
    requests_in_flight: int = 0
    """Forwarded requests open when the config applied: they carry on, under the new config."""
    held_requests: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "applied": self.applied,
            "generation": self.generation,
            "config_hash": self.config_hash,
            "changes": list(self.changes),
            "policy_rebuilt": self.policy_rebuilt,
            "requests_in_flight": self.requests_in_flight,
            "held_requests": self.held_requests,
        }


def changed_fields(old: RouterConfig, new: RouterConfig) -> tuple[str, ...]:
    """Top-level fields whose values differ."""
    return tuple(
        name for name in RouterConfig.model_fields if getattr(old, name) != getattr(new, name)
    )


def check_reload(
    old: RouterConfig, new: RouterConfig, live_classes: set[str]
) -> None:
    """Raise ``StaleConfig`` or ``ConfigRejected`` when ``new`` must not replace ``old``."""
    if new.generation < old.generation:
        raise StaleConfig(
            f"generation {new.generation} is older than the applied {old.generation}",
            param="generation",
        )
    kept = {c.name for c in new.workloads.classes}
    dropped = sorted(live_classes - kept)
    if dropped:
        raise ConfigRejected(
            f"workloads.classes drops {dropped}, which still have live sessions or held "
            "requests; remove them once they have drained",
            param="workloads.classes",
        )


def apply_config(state: RouterState, new: RouterConfig, source: str) -> ReloadResult:
    """Apply ``new`` atomically (no await inside), or raise without changing anything."""
    old = state.config
    new_hash = new.config_hash()
    # Counted in the same synchronous step as the apply: the live work the new config takes over.
    n_in_flight, n_held = len(state.dispatcher.in_flight), state.runner.held_count()
    if new_hash == state.config_hash:
        return ReloadResult(False, old.generation, state.config_hash, (),
                            requests_in_flight=n_in_flight, held_requests=n_held)
    runner = state.runner
    live = set(runner.active_sessions()) | {e.req.workload_class for e in runner.held()}
    check_reload(old, new, live)
    changes = changed_fields(old, new)
    now = state.clock()
    rebuilt = False
    if old.policy != new.policy or old.workloads != new.workloads:
        # Knob changes are applied in place (what the policy learned survives); a change
        # of policy hands the live state (held, sessions, in flight) to a new policy object.
        in_flight = [(f.meta, f.engine_id) for f in state.dispatcher.in_flight.values()]
        rebuilt = runner.apply_settings(new.policy, new.workloads, now, in_flight)
        if rebuilt:
            runner.on_metrics(state.registry.snapshots(), now)
    state.config = new
    state.config_hash = new_hash
    state.last_reload_error = None
    if old.engines != new.engines:
        urls = new.engines.static_urls()
        if urls is not None:
            state.registry.set_engines(urls)
        state.engines_changed.set()
    state.metrics.reloads.labels(source, "applied").inc()
    log.info(
        "config generation %d applied from %s (hash %s; changed: %s)",
        new.generation, source, new_hash, ", ".join(changes) or "nothing",
    )
    state.dispatcher.kick()
    state.touch()
    return ReloadResult(True, new.generation, new_hash, changes, rebuilt,
                        requests_in_flight=n_in_flight, held_requests=n_held)


def refuse(state: RouterState, source: str, reason: str) -> None:
    """Record a refused reload (shown in /status as ``last_reload_error``)."""
    state.last_reload_error = reason
    state.metrics.reloads.labels(source, "refused").inc()
    log.warning("config from %s refused, old one kept: %s", source, reason)
    state.touch()


def file_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def reload_from_bytes(state: RouterState, data: bytes, source: str) -> ReloadResult:
    """Parse and apply; every refusal is recorded and re-raised as a domain error."""
    try:
        new = parse_config(data)
    except ConfigError as exc:
        refuse(state, source, str(exc))
        raise ConfigRejected(f"invalid config: {exc}") from None
    try:
        return apply_config(state, new, source)
    except RouterError as exc:
        refuse(state, source, exc.message)
        raise


async def watch_config_file(state: RouterState, path: Path) -> None:
    """Poll ``path`` by content hash; apply each new content once (refusals are logged)."""
    try:
        last = file_digest(path.read_bytes())
    except OSError:
        last = None
    while True:
        await asyncio.sleep(state.config.config_poll_interval_s)
        try:
            data = path.read_bytes()
        except OSError as exc:  # mid-swap or unmounted: try again next poll
            log.debug("cannot read %s: %s", path, exc)
            continue
        digest = file_digest(data)
        if digest == last:
            continue
        last = digest
        # A refusal is recorded by reload_from_bytes; the old config stays.
        with contextlib.suppress(RouterError):
            reload_from_bytes(state, data, "file")
