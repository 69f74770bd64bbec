"""verl's rollout server manager over HTTP, for a disaggregated deployment behind the router.

verl's agent loops call ``server_manager.generate(request_id, prompt_ids=..., sampling_params=...)``
on an ``AsyncLLMServerManager`` (``verl/experimental/agent_loop/agent_loop.py``), which picks a
vLLM replica's Ray actor (least requests, sticky by ``request_id``) and returns a
``TokenOutput`` (``verl/workers/rollout/replica.py``). ``HttpServerManager`` has the same
``generate`` and answers the same fields, but sends ``POST /v1/completions`` with the token
ids to the router, and lets the router place: the stickiness becomes the session
(``X-Session-Id: <request_id>``, a turn counted per call), so every turn of a trajectory
lands where its KV is. Read from verl at commit b178a3cd56f58b2d502255daba591e92833930a7.

Plug it in by setting ``self.server_manager`` before ``AgentLoopWorker.__init__`` runs (it
builds its own only ``if not hasattr(self, "server_manager")``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ..retry import HoldRetry
from ..session import AsyncRolloutSession
from ..transport import DEFAULT_TIMEOUT_S, open_http

if TYPE_CHECKING:
    import aiohttp

DEFAULT_ROLLOUT_CLASS = "agentic"
"""verl's agent loops are multi-turn trajectories."""
MAX_CACHE_SIZE = 10000
"""Trajectories whose turn count is remembered (verl's own ``max_cache_size`` default); an
evicted one is left to the router's session idle timeout."""
_MAX_TOKENS_KEYS = ("max_tokens", "max_new_tokens")
"""verl's names for the response budget (``max_new_tokens`` is SGLang's, which verl accepts)."""
_TOKEN_ID_PREFIX = "token_id:"


class TokenOutput(BaseModel):
    """verl's ``TokenOutput`` fields (``verl/workers/rollout/replica.py``)."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    """``completed`` (vLLM's stop or length), ``aborted`` (abort), else vLLM's finish reason."""
    num_preempted: int | None = None


def completion_body(model: str, prompt_ids: list[int], sampling_params: Mapping[str, Any],
                    default_max_tokens: int) -> dict[str, Any]:
    """The ``/v1/completions`` body for verl's ``prompt_ids`` and ``sampling_params``.

    verl's vLLM server turns ``logprobs: bool`` into vLLM's ``logprobs=0`` (the sampled token's
    logprob only); the same here, with ``return_tokens_as_token_ids`` so each logprob names its
    token id. Every other key (temperature, top_p, top_k, repetition_penalty, ...) is one of
    vLLM's sampling fields and passes as given.
    """
    params = dict(sampling_params)
    max_tokens = default_max_tokens
    for key in _MAX_TOKENS_KEYS:
        if key in params:
            max_tokens = int(params.pop(key))
            break
    want_logprobs = bool(params.pop("logprobs", False))
    body: dict[str, Any] = {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens,
                            "return_token_ids": True, **params}
    if want_logprobs:
        body["logprobs"] = 0
        body["return_tokens_as_token_ids"] = True
    return body


def stop_reason(finish_reason: str | None) -> str | None:
    """vLLM's ``finish_reason`` as verl's ``stop_reason``."""
    if finish_reason == "abort":
        return "aborted"
    if finish_reason in ("stop", "length"):
        return "completed"
    return finish_reason


def token_output(answer: Mapping[str, Any]) -> TokenOutput:
    """A ``/v1/completions`` answer (one choice) as verl's ``TokenOutput``."""
    choice = answer["choices"][0]
    logprobs = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None and logprobs.get("tokens") is not None:
        ids = [int(t.removeprefix(_TOKEN_ID_PREFIX)) for t in logprobs["tokens"]]
    if ids is None:
        raise ValueError("the answer carries no token ids (needs return_token_ids or return_tokens_as_token_ids)")
    log_probs = logprobs.get("token_logprobs")
    return TokenOutput(token_ids=list(ids), log_probs=None if log_probs is None else list(log_probs),
                       stop_reason=stop_reason(choice.get("finish_reason")))


class HttpServerManager:
    """``AsyncLLMServerManager.generate`` over HTTP to the router.

    ``router_url``: the router (no ``/v1``); ``model``: its served model name;
    ``rollout_class``: the workload class of these trajectories; ``default_max_tokens``: the
    response budget when ``sampling_params`` has none (verl's server computes it from
    ``response_length``; pass that).
    """

    def __init__(
        self,
        router_url: str,
        model: str,
        *,
        default_max_tokens: int,
        rollout_class: str = DEFAULT_ROLLOUT_CLASS,
        http: aiohttp.ClientSession | None = None,
        retry: HoldRetry | None = None,
        max_cache_size: int = MAX_CACHE_SIZE,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.router_url = router_url.rstrip("/")
        self.model = model
        self.rollout_class = rollout_class
        self.default_max_tokens = default_max_tokens
        self._http = http
        self._owns_http = http is None
        self._retry = retry
        self._timeout_s = timeout_s
        self._max_cache_size = max_cache_size
        self._sessions: OrderedDict[str, AsyncRolloutSession] = OrderedDict()

    def _new_session(self, request_id: str) -> AsyncRolloutSession:
        if self._http is None:
            self._http = open_http()
        return AsyncRolloutSession(self.router_url, self.rollout_class, request_id, http=self._http,
                                   retry=self._retry, timeout_s=self._timeout_s)

    def _session(self, request_id: str) -> AsyncRolloutSession:
        session = self._sessions.get(request_id)
        if session is None:
            session = self._new_session(request_id)
            self._sessions[request_id] = session
            while len(self._sessions) > self._max_cache_size:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(request_id)
        return session

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
    ) -> TokenOutput:
        """Generate from ``prompt_ids``; every call with one ``request_id`` is a turn of one
        session (verl's sticky session)."""
        if image_data is not None or video_data is not None:
            raise NotImplementedError("multi-modal inputs need vLLM's in-process TokensPrompt; "
                                      "the router's /v1/completions takes token ids only")
        body = completion_body(self.model, prompt_ids, sampling_params, self.default_max_tokens)
        answer = await self._session(request_id).completions(**body)
        return token_output(answer)

    def turns(self, request_id: str) -> int:
        """Requests sent so far for ``request_id`` (0 when unknown or evicted)."""
        session = self._sessions.get(request_id)
        return session.turns if session is not None else 0

    async def end_session(self, request_id: str) -> bool:
        """End a finished trajectory at the router now (True when it was live there); verl has no
        such call, so without it the router ends the session when it has been idle long enough."""
        session = self._sessions.pop(request_id, None) or self._new_session(request_id)
        return await session.end()

    async def close(self) -> None:
        """Forget the trajectories and close the HTTP session this manager opened (not one it was
        given)."""
        self._sessions.clear()
        if self._owns_http and self._http is not None:
            await self._http.close()
            self._http = None
