"""Pure: the HAProxy configuration in front of router shards (docs/router.md, "Router shards").

One function, ``haproxy_config``, used by the operator (a ConfigMap beside
an ``haproxy`` Deployment, servers by their headless-Service DNS names) and
by ``misat up --shards`` (servers on loopback ports), so both run the same
proxy. What it asks of HAProxy 2.6, each verified in its configuration
manual (``/usr/share/doc/haproxy/configuration.txt.gz``):

- ``balance hdr(X-Session-Id)`` with ``hash-type consistent``: every turn of
  a session reaches the same shard, and a shard's loss or return moves only
  the sessions hashed to it. A request without the header is balanced round
  robin (the manual: "If the header is absent or if it does not contain any
  value, the roundrobin algorithm is applied instead"). Servers carry fixed
  ``id``s, so two proxies with this config hash alike;
- health checks ``GET /health`` (the shard process, not its engines: a shard
  whose engines are all down still answers its sessions with the router's own
  503 naming the engines, rather than the proxy's);
- ``retry-on conn-failure empty-response`` with ``option redispatch 1``: a
  request whose shard refused the connection, or closed it without a byte of
  answer (killed mid-request), is sent again to another shard. A rollout
  request replayed on another shard is a new generation there; nothing on the
  dead shard can answer it any more. ``option http-buffer-request`` makes
  the proxy read the whole body before it connects: without it a request
  forwarded while its body was still arriving is not replayable, and the proxy
  closed the client's connection without an answer when the shard died (seen
  here in the kill test). Bodies over ``tune.bufsize`` cannot be replayed
  (HAProxy keeps one buffer), so the buffer is sized for typical rollout
  prompts (``BUFSIZE_BYTES``);
- ``/admin/`` goes to any one shard like a request without a session id: the
  shard applies a state-changing admin call on every live shard
  (``misat_router.shard_admin``), so a trainer's admin client needs only the
  pool's address.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SESSION_HEADER = "X-Session-Id"
"""The header the proxy hashes (the router's session label, docs/router.md)."""
HEALTH_PATH = "/health"

CONNECT_TIMEOUT_S = 2
"""As the router's upstream_connect_timeout_s: a shard that does not accept within 2 s is tried elsewhere."""
IDLE_TIMEOUT_S = 3600
"""Client and server silence allowed (the router's upstream_timeout_s: a non-streamed long rollout
sends nothing until it ends)."""
KEEPALIVE_TIMEOUT_S = 75
"""Idle client keep-alive, as the router's own server (aiohttp's 75 s). It must outlast the clients'
pool idle time (httpx 5 s, aiohttp 15 s): a proxy closing first races a client's next request on
that connection, which then fails without an answer (seen here with a 2 s value)."""
CHECK_INTERVAL_MS = 500
"""Health-check spacing of each shard (as RouterConfig.health_interval_s for engines)."""
CHECK_FALL = 2
"""Failed checks that take a shard out (a killed shard is out within about a second; the requests
meanwhile are retried and redispatched)."""
CHECK_RISE = 1
"""Passed checks that bring a restarted shard back (its sessions hash to it again)."""
RETRIES = 3
"""Attempts beyond the first for one request (each may land on another shard: redispatch 1)."""
BUFSIZE_BYTES = 262_144
"""tune.bufsize: a request body up to this size can be replayed on another shard after an
empty response (HAProxy's default 16 KiB would replay only short prompts); memory is two
buffers per active connection."""
RESOLVERS = "cluster"
"""Name of the resolvers section (the pod's /etc/resolv.conf) for DNS-named servers."""
DNS_HOLD_VALID_S = 5
"""How long a resolved shard address is trusted (a restarted pod gets a new IP)."""


@dataclass(frozen=True, slots=True)
class ShardServer:
    """One router shard as the proxy reaches it."""

    host: str
    port: int


def haproxy_config(
    servers: Sequence[ShardServer], *, bind_address: str, bind_port: int, dns: bool, log_requests: bool = False
) -> str:
    """The whole ``haproxy.cfg``. ``dns``: servers are DNS names re-resolved at run time (pods that
    are not up yet or restart with a new IP); False: fixed addresses (``misat up``).
    ``log_requests``: one line per request on stdout (its retries and redispatches included)."""
    if not servers:
        raise ValueError("haproxy_config needs at least one shard")
    # An IPv6 wildcard takes IPv4 too ("v4v6"), so a single- or dual-stack cluster reaches it alike.
    bind = f"[{bind_address}]:{bind_port} v4v6" if bind_address == "::" else (
        f"[{bind_address}]:{bind_port}" if ":" in bind_address else f"{bind_address}:{bind_port}")
    lines = [
        "# Rendered by misat_operator.haproxy: router shards behind session-id hashing (docs/router.md).",
        # No maxconn: HAProxy derives it from the file-descriptor limit it runs under (a container's is
        # usually 1Mi), where a fixed value above that limit is a start-up error.
        "global",
        f"    tune.bufsize {BUFSIZE_BYTES}",
        "",
        "defaults",
        "    mode http",
        f"    timeout connect {CONNECT_TIMEOUT_S}s",
        f"    timeout client {IDLE_TIMEOUT_S}s",
        f"    timeout server {IDLE_TIMEOUT_S}s",
        f"    timeout http-keep-alive {KEEPALIVE_TIMEOUT_S}s",
        f"    retries {RETRIES}",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response",
        "    option http-buffer-request",
        "",
    ]
    if dns:
        lines += [
            f"resolvers {RESOLVERS}",
            "    parse-resolv-conf",
            f"    hold valid {DNS_HOLD_VALID_S}s",
            "",
        ]
    if log_requests:
        lines[lines.index("global") + 1:lines.index("global") + 1] = ["    log stdout format raw local0"]
        lines[lines.index("defaults") + 1:lines.index("defaults") + 1] = ["    log global", "    option httplog"]
    lines += [
        "frontend rollouts",
        f"    bind {bind}",
        "    default_backend shards",
        "",
        "backend shards",
        f"    balance hdr({SESSION_HEADER})",
        "    hash-type consistent",
        f"    option httpchk GET {HEALTH_PATH}",
        "    http-check expect status 200",
    ]
    default_server = f"    default-server check inter {CHECK_INTERVAL_MS}ms fall {CHECK_FALL} rise {CHECK_RISE}"
    if dns:
        default_server += f" resolvers {RESOLVERS} init-addr last,libc,none"
    lines.append(default_server)
    for i, s in enumerate(servers):
        host = f"[{s.host}]" if ":" in s.host else s.host
        lines.append(f"    server shard-{i} {host}:{s.port} id {i + 1}")
    return "\n".join(lines) + "\n"
