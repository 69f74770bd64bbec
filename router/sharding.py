"""Router shards: which engines a shard owns, and which peer shards are alive (pure, no I/O).

Several routers run behind a proxy that hashes the session id (HAProxy,
docs/router.md "Router shards"); each shard admits only against the engines
it owns, so no two shards count the same KV. Ownership is a pure function of
the ordered engine list, the set of live shards and the shard's own index,
computed identically by every shard from the same config:

- the home shard of the engine at position ``i`` is ``i mod shards``, so in
  steady state the engines split as evenly as they can (rendezvous hashing
  alone leaves a shard with no engine in one pool out of two for 2 engines
  over 2 shards);
- an engine whose home shard is down goes to the live shard with the highest
  rendezvous weight ``sha256(shard, engine)``: a shard's loss moves only its
  own engines, spread over the survivors, and its return moves exactly those
  back (the weights do not depend on which shards are live).

The engine list is the one the router already uses (``engines.urls`` in
config order, or a headless Service's addresses sorted), so every shard sees
the same positions; a scale event that shifts positions moves engines
between shards, which costs those engines' warm prefix caches, not requests.

``PeerLiveness`` turns peer ``/health`` results into the live set with the
same consecutive-results rule as engine health. A peer starts out live: a
shard (re)starting owns its share at once, and engines move only on
evidence that their home shard is down.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

_ORDINAL = re.compile(r"-(\d+)$")


def rendezvous_weight(engine_id: str, shard: int) -> int:
    """The engine's weight for ``shard`` (stable across processes and Python versions)."""
    digest = hashlib.sha256(f"{shard}\x00{engine_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def engine_owner(position: int, engine_id: str, shards: int, live: Collection[int]) -> int | None:
    """The shard owning the engine at ``position`` of the list; None when no shard is live."""
    home = position % shards
    if home in live:
        return home
    candidates = [s for s in live if 0 <= s < shards]
    if not candidates:
        return None
    return max(candidates, key=lambda s: (rendezvous_weight(engine_id, s), -s))


def owned_engines(engines: Sequence[str], shards: int, live: Collection[int], index: int) -> list[str]:
    """The engines shard ``index`` owns, in list order; a shard always counts itself live."""
    alive = {*live, index}
    return [e for i, e in enumerate(engines) if engine_owner(i, e, shards, alive) == index]


def index_from_hostname(hostname: str) -> int | None:
    """A StatefulSet pod's ordinal from its hostname (``pool-router-2`` -> 2), or None."""
    match = _ORDINAL.search(hostname.split(".", 1)[0])
    return int(match.group(1)) if match else None


SHARD_DOWN = "down (its engines are taken over by the live shards)"
"""How a pool-wide answer (admin fan-out, ``/status?scope=pool``) describes a shard its peers see down."""


@dataclass(slots=True)
class _Peer:
    live: bool = True
    failures: int = 0
    successes: int = 0
    last_error: str | None = None


@dataclass(slots=True)
class PeerLiveness:
    """Which shards are live, from this shard's ``/health`` checks of its peers."""

    shards: int
    index: int
    _peers: dict[int, _Peer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._peers = {i: _Peer() for i in range(self.shards) if i != self.index}

    def resize(self, shards: int) -> None:
        """A reload changed the shard count: new peers start live, gone ones are forgotten."""
        self.shards = shards
        self._peers = {i: self._peers.get(i, _Peer()) for i in range(shards) if i != self.index}

    def record(self, peer: int, ok: bool, *, down_after: int, up_after: int, error: str | None = None) -> bool:
        """One check of ``peer``; True when it changed the live set."""
        st = self._peers.get(peer)
        if st is None:
            return False
        if ok:
            st.failures, st.successes, st.last_error = 0, st.successes + 1, None
            if not st.live and st.successes >= up_after:
                st.live = True
                return True
            return False
        st.successes, st.failures, st.last_error = 0, st.failures + 1, error
        if st.live and st.failures >= down_after:
            st.live = False
            return True
        return False

    def live(self) -> frozenset[int]:
        """Live shards, this one included."""
        return frozenset({self.index, *(i for i, p in self._peers.items() if p.live)})

    def peers(self) -> list[int]:
        return sorted(self._peers)

    def live_peers(self) -> list[int]:
        """The peers seen live, in index order: the shards a pool-wide call is sent on to."""
        return [i for i, p in sorted(self._peers.items()) if p.live]

    def detail(self, answered: Mapping[int, str]) -> dict[str, str]:
        """A pool-wide answer's ``shards``: per shard index in order (as JSON keys), what the shards
        that were asked said, and ``SHARD_DOWN`` for the peers that were not."""
        return {str(i): answered.get(i, SHARD_DOWN) for i in sorted({*answered, *self._peers})}

    def last_error(self, peer: int) -> str | None:
        st = self._peers.get(peer)
        return st.last_error if st else None


SHARD_HEADER = "X-Misat-Shard"
"""Response header naming the shard that answered (its index), on every answer of a shard."""
