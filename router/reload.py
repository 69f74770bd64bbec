"""Hot reload: the rules for replacing the applied RouterConfig, and the watched-file source.

Sources: ``PUT /admin/config`` and a watched file. The apply itself is
``RouterState.apply_config`` (``state.py``), built on ``check_reload`` and
``changed_fields`` here. It is synchronous, so it runs between two decisions of the one
event loop: no request ever sees half a config. What a reload keeps and what
it changes:

- **Always kept**: the HOLD ledger (held requests, in arrival order),
  requests in flight and their streams, the runner's sessions, the consumed
  mixture counts, engine health and metrics.
- **Workloads changed, policy settings not**: ``runner.set_mix`` retargets the
  mixture and tells the policy (which keeps what it learned).
- **Policy settings changed, same policy**: the knobs are applied in place
  (``PolicyRunner.apply_settings``), so what the policy learned (footprint and
  residency estimates, hit-rate history, the prefix index) is kept.
- **Policy name changed** (or the static concurrency limit added or removed):
  a new policy is built and the live work is re-registered with it: held requests (``on_hold``), in-flight
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import RouterConfig
from .errors import ConfigRejected, RouterError, StaleConfig

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


def file_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def watch_config_file(
    path: Path, apply: Callable[[bytes], object], poll_interval_s: Callable[[], float]
) -> None:
    """Poll ``path`` by content hash; hand each new content to ``apply`` once.

    ``apply`` is ``RouterState.reload`` bound to the source ``"file"``; its
    ``RouterError`` refusals are recorded there and the old config stays.
    The interval is read before every poll, so a reload of it applies at once.
    """
    try:
        last = file_digest(path.read_bytes())
    except OSError:
        last = None
    while True:
        await asyncio.sleep(poll_interval_s())
        try:
            data = path.read_bytes()
        except OSError as exc:  # mid-swap or unmounted: try again next poll
            log.debug("cannot read %s: %s", path, exc)
            continue
        digest = file_digest(data)
        if digest == last:
            continue
        last = digest
        with contextlib.suppress(RouterError):
            apply(data)
