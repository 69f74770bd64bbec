"""AReaL's remote-vLLM engine in front of the router.

AReaL (``areal/engine/vllm_remote.py``, read at commit
4aef98d8d818af55b43621aaadba047ae10f4e77) builds each generation as an ``HttpRequest``
(``endpoint``, ``payload``, ``method``) in ``VLLMBackend.build_generation_request`` and sends
it with ``arequest_with_retry``, which takes no headers; its control calls
(``/areal_pause_generation``, ``/areal_continue_generation``, ``/areal_update_weights``,
``/sleep``, ``/wake_up``) go to every server address in ``_run_request_on_all_servers`` and the
weight-update helpers.

Pointed at the router (its one address), two pieces make that work:

- ``LabelledBackend(VLLMBackend(), "rlvr")`` wraps AReaL's backend: every generation payload
  gains the router's body labels (``"rollout": {"class", "session_id": rid, "turn"}``; the
  router strips them before vLLM sees the body), so the class and session arrive without a
  header hook; AReaL resubmits an aborted request with the same ``rid`` and its partial output
  appended, which the router sees as the next turn of the same session. Everything else is
  AReaL's own backend.
- ``AReaLControl(SyncAdminClient(router, token))`` runs AReaL's control requests through the
  router's admin API instead of at the router's generation port: pause is the router's
  ``pause?mode=abort`` (AReaL's own pause aborts in-flight work and clears the cache),
  continue is ``resume`` with a prefix-cache reset and the weight version, ``/sleep`` and
  ``/wake_up`` fan out, and a weight update (``/areal_update_weights`` with a
  ``model_path``) passes through to every engine (``/admin/engines/call``). Sync, like
  AReaL's trainer-side calls.

Not routed: ``/areal_init_weights_update_group`` (its ``rank_offset`` differs per server, and
one pass-through body goes to every engine, so NCCL/XCCL weight updates need AReaL's direct
per-server addresses), and ``/v1/load_lora_adapter`` (a ``/v1/`` path, which the router's
pass-through refuses as a generation path).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlsplit

from ..admin import EngineCall, SyncAdminClient
from ..admin_models import EngineFanOut, EngineOp, PauseMode, PauseResult, ResumeResult, WeightUpdateResult
from ..labels import RolloutLabels
from .actions import AdminAction, FanOutAction, NotRoutable, PassThroughAction, PauseAction, ResumeAction

PAUSE_ENDPOINT = "/areal_pause_generation"
CONTINUE_ENDPOINT = "/areal_continue_generation"
SLEEP_ENDPOINT = "/sleep"
WAKE_UP_ENDPOINT = "/wake_up"
HEALTH_ENDPOINT = "/health"
PER_SERVER_ENDPOINTS = frozenset({"/areal_init_weights_update_group"})
"""AReaL calls whose payload differs per server (NCCL ranks): one fan-out body cannot carry them."""
GENERATION_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions"})
RID_CACHE_SIZE = 128
"""Sessions whose turn count is remembered (AReaL keeps the same number of rid -> server
entries, ``RID_CACHE_SIZE`` in ``remote_inf_engine.py``); an evicted rid restarts at turn 0,
which the router still places as the same session."""


class HttpRequestLike(Protocol):
    """AReaL's ``areal.api.io_struct.HttpRequest`` (a dataclass with these fields)."""

    endpoint: str
    payload: dict[str, Any]
    method: str


class ModelRequestLike(Protocol):
    """The part of AReaL's ``ModelRequest`` the labels need: its request id."""

    rid: str


class LabelledBackend:
    """AReaL's ``VLLMBackend`` with the router's labels added to every generation payload."""

    def __init__(self, inner: Any, rollout_class: str, *, rid_cache_size: int = RID_CACHE_SIZE) -> None:
        self._inner = inner
        self.rollout_class = rollout_class
        self._turns: OrderedDict[str, int] = OrderedDict()
        self._rid_cache_size = rid_cache_size

    def _next_turn(self, rid: str) -> int:
        turn = self._turns.pop(rid, 0)
        self._turns[rid] = turn + 1
        while len(self._turns) > self._rid_cache_size:
            self._turns.popitem(last=False)
        return turn

    def build_generation_request(self, req: ModelRequestLike, with_lora: bool, version: int) -> Any:
        """AReaL's request, its payload labelled with the class, ``rid`` as session and the turn."""
        http_req = self._inner.build_generation_request(req, with_lora, version)
        labels = RolloutLabels(rollout_class=self.rollout_class, session_id=str(req.rid),
                               turn=self._next_turn(str(req.rid)))
        out = copy.copy(http_req)
        out.payload = labels.add_to_body(http_req.payload)
        return out

    def __getattr__(self, name: str) -> Any:
        # Everything but the generation request is AReaL's backend unchanged.
        return getattr(self._inner, name)


# ---- control: AReaL's requests as admin calls (pure) -------------------------------------


def admin_action(endpoint: str, payload: dict[str, Any] | None = None, method: str = "POST") -> AdminAction:
    """What the router's admin API does for one of AReaL's control requests."""
    parts = urlsplit(endpoint)
    path, query = parts.path, parts.query
    if path == PAUSE_ENDPOINT:
        return PauseAction()
    if path == CONTINUE_ENDPOINT:
        return ResumeAction()
    if path == SLEEP_ENDPOINT:
        return FanOutAction(EngineOp.SLEEP, dict(parse_qsl(query)))
    if path == WAKE_UP_ENDPOINT:
        # AReaL sends one ``tags=`` per tag; the fan-out's query is a flat mapping that would
        # keep only the last, so several tags are refused rather than silently dropped.
        pairs = parse_qsl(query)
        if len({k for k, _ in pairs}) != len(pairs):
            raise NotRoutable(f"{endpoint}: repeated query keys cannot pass through the fan-out")
        return FanOutAction(EngineOp.WAKE_UP, dict(pairs))
    if path in PER_SERVER_ENDPOINTS:
        raise NotRoutable(f"{path}: its payload differs per server (NCCL ranks); send it to each engine directly")
    if path in GENERATION_ENDPOINTS or path.startswith("/v1/"):
        raise NotRoutable(f"{path}: a /v1/ path is not a control call the router passes through")
    if path == HEALTH_ENDPOINT:
        raise NotRoutable(f"{path}: ask the router's own /health or /ready")
    return PassThroughAction(EngineCall(path=path, body=payload or {}, method=method.upper(),
                                        query=dict(parse_qsl(query))))


class AReaLControl:
    """AReaL's control requests, executed through the router's admin API (sync)."""

    def __init__(self, admin: SyncAdminClient) -> None:
        self.admin = admin

    def run(self, http_req: HttpRequestLike, *, version: int | str | None = None
            ) -> PauseResult | ResumeResult | EngineFanOut:
        """Do what AReaL's ``_run_request_on_all_servers(http_req)`` would do on every server.
        ``version``: the weight version recorded on a continue or a weight-update call."""
        action = admin_action(http_req.endpoint, http_req.payload, http_req.method)
        v = None if version is None else str(version)
        if isinstance(action, PauseAction):
            return self.admin.pause(action.mode, reset_prefix_cache=action.reset_prefix_cache)
        if isinstance(action, ResumeAction):
            return self.admin.resume(reset_prefix_cache=action.reset_prefix_cache, weight_version=v)
        if isinstance(action, FanOutAction):
            return self.admin.engines(action.op, action.query)
        return self.admin.engine_call(action.call, weight_version=v)

    def pause_generation(self) -> PauseResult:
        """AReaL's ``pause_generation``: hold new work, abort what is in flight."""
        action = PauseAction()
        return self.admin.pause(action.mode, reset_prefix_cache=action.reset_prefix_cache)

    def continue_generation(self, version: int | str | None = None) -> ResumeResult:
        """AReaL's ``continue_generation``, recording ``version`` for every engine."""
        return self.admin.resume(reset_prefix_cache=True, weight_version=None if version is None else str(version))

    def update_weights(self, requests: list[HttpRequestLike], version: int | str) -> WeightUpdateResult:
        """AReaL's weight-update requests (``build_disk_weight_update_requests(meta).requests``)
        as the router's sequence: pause with abort, each call to every engine, resume with a
        prefix-cache reset and ``version``."""
        calls = []
        for r in requests:
            action = admin_action(r.endpoint, r.payload, r.method)
            if not isinstance(action, PassThroughAction):
                raise NotRoutable(f"{r.endpoint}: not a weight-update call")
            calls.append(action.call)
        return self.admin.update_weights(calls, version=str(version), mode=PauseMode.ABORT)
