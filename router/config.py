"""RouterConfig: everything the router service needs, as one validated, frozen value.

This is the ConfigMap payload the operator renders from a RolloutPool and the
body of ``PUT /admin/config``. Every knob has a documented default; where the
MISA-T paper gives no value the default is this project's choice and says why.
Decoding is strict (unknown keys are errors) and error messages name the path
(``workloads.classes[1].share``), so a typo fails loudly at start-up or is
refused by a reload, never silently ignored.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .policy.settings import PolicySettings, WorkloadMix


class ConfigError(ValueError):
    """A config could not be read or is invalid; the message names the offending path."""


class _Frozen(BaseModel):
    # No inf/nan: an infinite timeout or interval overflows aiohttp's and asyncio's timers.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ServiceRef(_Frozen):
    """A headless Kubernetes Service whose DNS name resolves to one address per engine pod."""

    name: str = Field(min_length=1, description="DNS name, e.g. 'pool-engines.ns.svc.cluster.local'.")
    port: int = Field(8000, ge=1, le=65535, description="Engine HTTP port (vLLM's default 8000).")
    scheme: Literal["http", "https"] = Field("http", description="URL scheme of the engines.")


class EnginesConfig(_Frozen):
    """Where the engines are: a fixed URL list, or a headless Service re-resolved periodically."""

    urls: tuple[str, ...] | None = Field(
        None, description="Base URLs of the engines, e.g. 'http://10.0.0.5:8000' (no path)."
    )
    service: ServiceRef | None = Field(
        None, description="A headless Service resolved to one engine per address."
    )
    resolve_interval_s: float = Field(
        5.0, gt=0.0,
        description="Seconds between DNS re-resolutions of `service` (project default: pods "
        "joining or leaving show up within a few seconds without hammering the resolver).",
    )
    draining: tuple[str, ...] = Field(
        (),
        description="Engine ids (base URLs, as /status lists them) that take no new sessions: "
        "continuations of their live sessions still go there, so those sessions finish where "
        "their KV is. The operator sets it before a scale-down removes these engines.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> EnginesConfig:
        if (self.urls is None) == (self.service is None):
            raise ValueError("give exactly one of 'urls' or 'service'")
        if self.urls is not None:
            if not self.urls:
                raise ValueError("'urls' must name at least one engine")
            for i, url in enumerate(self.urls):
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"urls[{i}] {url!r} must start with http:// or https://")
            if len(set(self.urls)) != len(self.urls):
                raise ValueError("'urls' must not repeat an engine")
        for i, url in enumerate(self.draining):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"draining[{i}] {url!r} must start with http:// or https://")
        return self

    def draining_ids(self) -> frozenset[str]:
        """The draining engines as engine ids (no trailing slash)."""
        if not self.draining:  # the admission hot path asks on every request
            return frozenset()
        return frozenset(u.rstrip("/") for u in self.draining)

    def static_urls(self) -> tuple[str, ...] | None:
        """The URL list with trailing slashes removed (engine ids), or None for a Service."""
        if self.urls is None:
            return None
        return tuple(u.rstrip("/") for u in self.urls)


class ShardsConfig(_Frozen):
    """Router shards: several routers behind a session-hashing proxy, each owning a disjoint subset
    of the engines (``sharding.py``; docs/router.md, "Router shards"). Every shard reads the same
    config; its own index comes from ``misat router --shard-index`` or its hostname's ordinal."""

    peers: tuple[str, ...] = Field(
        min_length=1,
        description="Base URL of every shard's router in shard-index order, this one included (a "
        "StatefulSet's pods through their headless Service: 'http://pool-router-0.pool-router-shards...').",
    )
    peer_probe_interval_s: float = Field(
        0.5, gt=0.0,
        description="Seconds between /health checks of each peer shard (project default: with "
        "peer_down_after_failures=2 a dead shard's engines are re-homed within about 1.5 s).",
    )
    peer_probe_timeout_s: float = Field(0.4, gt=0.0, description="Timeout of one peer /health check.")
    peer_status_timeout_s: float = Field(
        2.0, gt=0.0,
        description="Timeout of one peer's /status when a shard answers GET /status?scope=pool (a peer "
        "slower than this is reported unreachable in the answer's 'shards', not waited for).",
    )
    peer_down_after_failures: int = Field(
        2, ge=1,
        description="Consecutive failed peer checks after which the other shards take over its engines "
        "(project default: one lost probe under load does not move engines).",
    )
    peer_up_after_successes: int = Field(
        1, ge=1,
        description="Consecutive passed checks after which a returning shard gets its engines back.",
    )
    handback_idle_s: float = Field(
        60.0, ge=0.0,
        description="When a peer shard returns, the engines it takes back stay this shard's for the "
        "sessions it placed there (their next turns still go there, no new session does) until none "
        "of them has had a request for this long (project default: an agent's tool call between two "
        "turns; the sessions that moved to the returning shard stop arriving). 0: hand engines back "
        "at once (each of those sessions then re-prefills on this shard's own engines).",
    )

    @model_validator(mode="after")
    def _urls(self) -> ShardsConfig:
        for i, url in enumerate(self.peers):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"peers[{i}] {url!r} must start with http:// or https://")
        if len({u.rstrip("/") for u in self.peers}) != len(self.peers):
            raise ValueError("'peers' must not repeat a shard")
        return self

    def peer_urls(self) -> tuple[str, ...]:
        """The peers without trailing slashes, index i being shard i."""
        return tuple(u.rstrip("/") for u in self.peers)


class RouterConfig(_Frozen):
    """The router's whole configuration (ConfigMap payload, ``PUT /admin/config`` body)."""

    generation: int = Field(
        0, ge=0, le=2**63 - 1,  # a Kubernetes generation is an int64; /metrics exports it as a float
        description="Monotonic version set by the operator (the RolloutPool's generation). A "
        "reload carrying a lower generation than the applied one is refused as stale.",
    )
    model: str = Field(min_length=1, description="Served model name the engines expose.")
    engines: EnginesConfig = Field(description="Where the engines are (urls or service).")
    workloads: WorkloadMix = Field(description="Workload classes, target shares, default class.")
    policy: PolicySettings = Field(
        default_factory=lambda: PolicySettings.model_validate({}),
        description="Policy name and every knob (router/policy/settings.py).",
    )

    shards: ShardsConfig | None = Field(
        None,
        description="Router shards (RolloutPool router.shards > 1); None: this router owns every engine.",
    )

    hold_deadline_s: float = Field(
        300.0, gt=0.0,
        description="Longest a request may wait HELD before the client gets 503 with Retry-After "
        "(project default: well under the OpenAI client's 600 s timeout, so the client sees a "
        "clean answer rather than its own timeout).",
    )
    hold_retry_after_s: int = Field(
        5, ge=0, description="Retry-After seconds sent with a hold-deadline 503 (project default)."
    )
    no_healthy_engine_wait_s: float = Field(
        5.0, gt=0.0,
        description="While no engine is healthy, a request waits at most this long for one (a restart "
        "or a first probe) before a 503 no_healthy_engine naming each engine's last error, instead "
        "of the whole hold deadline (project default: a few health probes).",
    )
    scrape_interval_s: float = Field(
        0.25, gt=0.0,
        description="Seconds between /metrics scrapes of each engine (project default: about two "
        "scrapes per admission epoch; vLLM's gauges move visibly at this rate).",
    )
    scrape_timeout_s: float = Field(
        2.0, gt=0.0, description="Timeout of one /metrics scrape; after a failed scrape the policy reads the engine's "
        "load gauges as 0 (unknown) and counts its own sessions there until a scrape succeeds."
    )
    health_interval_s: float = Field(
        0.5, gt=0.0,
        description="Seconds between /health checks of each engine (project default: with "
        "unhealthy_after_failures=2 and health_timeout_s=0.4 a dead engine leaves rotation "
        "within about 1.5 s).",
    )
    health_timeout_s: float = Field(0.4, gt=0.0, description="Timeout of one /health check.")
    unhealthy_after_failures: int = Field(
        2, ge=1,
        description="Consecutive failures that take an engine out of rotation: failed health checks "
        "and connect timeouts while proxying (upstream_connect_timeout_s), counted together. A "
        "connection refused or broken while proxying takes it out at once, without waiting for this.",
    )
    healthy_after_successes: int = Field(
        1, ge=1, description="Consecutive passed health checks that bring an engine back."
    )
    upstream_connect_timeout_s: float = Field(
        2.0, gt=0.0,
        description="Timeout to open a connection to an engine; on expiry the request is placed "
        "again and the timeout counts as one of unhealthy_after_failures.",
    )
    upstream_timeout_s: float = Field(
        3600.0, gt=0.0,
        description="Longest silence (seconds without a byte) from an engine during one request "
        "(project default: a non-streamed 128K-token rollout sends nothing until it ends). Checked by "
        "one sweep a second (every quarter of the timeout when that is shorter), not a timer per request.",
    )
    upstream_max_connections: int | None = Field(
        None, ge=1,
        description="Pooled upstream connections in total; None: no limit (rollouts keep "
        "thousands of streams open). Read at start-up only.",
    )
    upstream_keepalive_s: float = Field(
        2.0, gt=0.0,
        description="Seconds an idle pooled connection to an engine is kept for reuse (project "
        "default). Under vLLM's own idle limit (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), so the router "
        "rarely reuses a connection the engine is closing; and short, so the pool follows each "
        "engine's current concurrency instead of every engine's recent peak (aiohttp's 15 s "
        "default held about 1.5 sockets per request in flight in the soak). Read at start-up only.",
    )
    max_placement_attempts: int = Field(
        3, ge=1,
        description="Engines tried for one request whose upstream connection fails before any "
        "byte reached the client (the first placement included).",
    )
    max_body_bytes: int = Field(
        32 * 1024 * 1024, ge=1024,
        description="Largest request body accepted (project default 32 MiB: a 128K-token prompt "
        "as token ids is under 1 MiB of JSON; chat histories are larger but not 30x).",
    )
    pause_resets_prefix_cache: bool = Field(
        False,
        description="Whether POST /admin/pause also calls every engine's /reset_prefix_cache "
        "when the request does not say (?reset_prefix_cache=...).",
    )
    config_poll_interval_s: float = Field(
        2.0, gt=0.0,
        description="Seconds between checks of the watched config file (a mounted ConfigMap).",
    )
    release_down_engine_after_s: float = Field(
        10.0, ge=0.0,
        description="An engine out of rotation this long has its sessions and KV accounting "
        "released (project default). Shorter outages, such as an overloaded engine missing two "
        "health checks, keep the books: forgetting the sessions there would let the router admit "
        "a flood of new ones onto KV that is still occupied. Removed engines release at once.",
    )
    drain_timeout_s: float = Field(
        30.0, ge=0.0,
        description="On shutdown, longest wait for in-flight requests to finish before the "
        "upstream connections are closed.",
    )
    sample_rate_window_s: float = Field(
        60.0, gt=0.0,
        description="Sliding window over which /status computes the sample rate (units/min).",
    )

    def config_hash(self) -> str:
        """A stable digest of the whole config (canonical JSON, sorted keys, sha256, 16 hex)."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _error_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<root>"


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the path, e.g. ``workloads.classes[1].share: ...``."""
    lines = []
    for err in exc.errors():
        # Drop pydantic's union/validator tags so the path reads like the YAML.
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        lines.append(f"{_error_path(loc)}: {err['msg']}")
    return "; ".join(lines)


def config_from_obj(obj: Any) -> RouterConfig:
    """Validate a decoded mapping into a RouterConfig, or raise ConfigError naming the paths."""
    if not isinstance(obj, dict):
        raise ConfigError(f"config must be a mapping, got {type(obj).__name__}")
    try:
        return RouterConfig.model_validate(obj)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None


def parse_config(text: str | bytes) -> RouterConfig:
    """Parse a YAML or JSON document (JSON is YAML) into a RouterConfig."""
    try:
        obj = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML/JSON: {exc}") from None
    except RecursionError:
        raise ConfigError("not a usable config: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer beyond Python's digit limit
        raise ConfigError(f"not a usable config: {exc}") from None
    return config_from_obj(obj)


def load_config(path: str | Path) -> RouterConfig:
    """Read and validate a config file; a missing file or a bad value is a ConfigError."""
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {str(path)!r}: {exc.strerror or exc}") from None
    return parse_config(text)
