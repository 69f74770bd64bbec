"""SkyRL's inference client in front of the router.

SkyRL (NovaSky-AI/SkyRL, read at commit a9564572eb8e91076be43c1bd5e4615e3de17265) drives all
inference through one ``InferenceEngineInterface``
(``skyrl/backends/skyrl_train/inference_servers/base.py``). Its one implementation,
``RemoteInferenceClient`` (``inference_servers/remote_inference_client.py``), sends generation
to a single data-plane URL (SkyRL's own vllm-router unless ``external_proxy_url`` is set) as
vLLM's ``POST /inference/v1/generate``, one request per prompt, with an ``X-Session-ID``
header. Every control call bypasses that URL and fans out from the client to each vLLM
server's own address. ``SkyRLGymGenerator`` (``skyrl/train/generators/skyrl_gym_generator.py``)
runs a trajectory as ``generate`` calls with ``session_ids=[f"{instance_id}_{repetition_id}"]``
and calls ``finish_session`` when the trajectory ends. Single-turn batches have no session
ids. (SkyRL #1835 removed the ``RemoteInferenceEngine`` / ``InferenceEngineClient`` pair that
earlier commits such as 01dc9de used.)

``RouterInferenceClient(router_url, admin_token, model_name=...)`` replaces
``RemoteInferenceClient`` and uses the router as its only address:

- Generation: each prompt becomes one labelled ``POST /v1/completions``. The body carries the
  token ids, SkyRL's vLLM sampling params as completion fields, and ``return_token_ids``. A
  prompt with a session id is the next turn of that router session (class ``agentic`` by
  default; turns are counted in a bounded LRU). A prompt without one is a request of the
  single-turn class (``rlvr`` by default). With ``pause_mode=abort``, when a pause aborts a
  generation, the router answers with the partial output and ``finish_reason: "abort"``. The
  client then sends the request again as the session's next turn, with the output so far
  appended, so SkyRL gets one whole response, as it would from vLLM's keep-mode pause.
- Control: ``pause_generation`` / ``resume_generation`` use the router's pause and resume
  (vLLM's keep mode, SkyRL's own, by default).
  Sleep, wake-up and prefix-cache resets use its engine fan-out. Weight-sync calls whose body
  is the same for every engine (checkpoint-delta ``/fetch_weights``, ``/update_weights``, the
  ``/collective_rpc`` start/finish, LoRA loads from disk) use its pass-through.
  ``finish_session`` ends the router session.

Not routed (``NotRoutable`` gives the reason): a weight-transfer group set-up whose payload
differs per engine (NCCL rank offsets), CUDA-IPC weight chunks, the chat-template render and
the LoRA unload (``/v1/`` paths that the router neither serves nor passes through), several
sleep or wake-up tags in one call, and multi-modal features.

SkyRL itself is not imported, since it pulls in torch and ray. Its input and output types are
mirrored below as TypedDicts, and its weight-sync init info is read through a Protocol.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from ..admin import EngineCall, SyncAdminClient
from ..admin_models import EngineFanOut, EngineOp, PauseMode, PauseResult, ResumeResult
from ..errors import MisatClientError
from ..retry import HoldRetry
from ..session import CHAT_PATH, COMPLETIONS_PATH, AsyncRolloutSession
from ..transport import open_http
from .actions import AdminAction, FanOutAction, NotRoutable, PassThroughAction, PauseAction, ResumeAction

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger("misat_client")

DEFAULT_ROLLOUT_CLASS = "agentic"
"""The class of prompts that carry a session id: SkyRLGymGenerator's multi-turn trajectories."""
DEFAULT_SINGLE_TURN_CLASS = "rlvr"
"""The class of prompts without one (``generate_batched``). It must be a single-turn class,
whose router session ends with its request."""
MAX_SESSIONS = 10_000
"""The number of trajectories whose turn count and engine are remembered. This is above the
trajectories a SkyRL batch runs at once (batch size x samples per prompt). An evicted
trajectory starts again at turn 0, and the router still places it as the same session."""
MAX_RESUBMITS = 8
"""How many times one generation is sent again after an abort. Each resubmission needs a
pause to abort it, so more than a few points to something else aborting it. SkyRL then gets
the abort, as its own client would pass it on."""
GENERATION_TIMEOUT_S = 3900.0
"""The longest wait for one generation: the router's ``upstream_timeout_s`` default (3600 s,
sized for long rollouts) plus its ``hold_deadline_s`` default (300 s). The router answers
before this expires. SkyRL's own client has no limit."""
ABORT = "abort"
"""vLLM's finish reason for an aborted request."""


# ---- SkyRL's types, mirrored (inference_servers/base.py) ----------------------------------


class InferenceEngineInput(TypedDict, total=False):
    """SkyRL's ``InferenceEngineInput``. SkyRL builds it with only the keys a call needs, so none
    is required here."""

    prompts: list[list[dict[str, str]]] | None
    prompt_token_ids: list[list[int]] | None
    sampling_params: dict[str, Any] | None
    session_ids: list[Hashable] | None
    mm_features: list[Any] | None
    cache_salt: str | None


class InferenceEngineOutput(TypedDict):
    """SkyRL's ``InferenceEngineOutput``."""

    responses: list[str]
    response_ids: list[list[int]]
    stop_reasons: list[str]
    response_logprobs: list[list[float]] | None
    prompt_logprobs: list[list[float]] | None
    rollout_expert_indices: list[Any] | None


class ServerInitInfo(Protocol):
    """One engine's share of SkyRL's ``WeightSyncInitInfo``."""

    def to_api_payload(self) -> dict[str, Any]: ...


class WeightSyncInitInfo(Protocol):
    """SkyRL's ``WeightSyncInitInfo`` (``BroadcastInitInfo``, ``DeltaInitInfo``): the part the
    client reads."""

    def for_servers(self, world_size_per_server: int, num_servers: int,
                    dp_size: int = 1) -> Sequence[ServerInitInfo]: ...


# ---- generation (pure) ----------------------------------------------------------------------


def session_key(raw: Hashable | None) -> str | None:
    """SkyRL's session id as the router's. SkyRL's client sends any truthy id as ``str(id)`` and
    skips the others, and this does the same."""
    return str(raw) if raw else None


def completion_body(model: str, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any],
                    cache_salt: str | None = None) -> dict[str, Any]:
    """The ``/v1/completions`` body for one SkyRL prompt.

    SkyRL's sampling params are vLLM ``SamplingParams`` fields (``get_vllm_sampling_params``:
    ``max_tokens``, ``min_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``logprobs``, ``stop``, ``skip_special_tokens``, ``include_stop_str_in_output``, plus any
    ``additional_kwargs``). vLLM's completion request accepts each of them under the same name,
    so they pass as given. A None means vLLM's default and is left out. ``return_token_ids``
    puts the output ids in the answer, because SkyRL trains on ids, not on re-tokenised text.
    """
    if int(sampling_params.get("n") or 1) > 1:
        raise ValueError("n > 1 is not supported (nor by SkyRL's own client): use generator.n_samples_per_prompt")
    body = {k: v for k, v in sampling_params.items() if v is not None}
    body.update(model=model, prompt=list(prompt_ids), return_token_ids=True)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def continuation_body(first: Mapping[str, Any], generated: Sequence[int]) -> dict[str, Any] | None:
    """``first`` sent again after an abort: the ``generated`` ids appended to its prompt and its
    token budgets reduced by them. None when no token is left to generate. (Without a
    ``max_tokens``, vLLM's default applies to each request on its own.)"""
    body = dict(first)
    body["prompt"] = [*first["prompt"], *generated]
    if "max_tokens" in first:
        left = int(first["max_tokens"]) - len(generated)
        if left < 1:
            return None
        body["max_tokens"] = left
    if "min_tokens" in first:
        body["min_tokens"] = max(0, int(first["min_tokens"]) - len(generated))
    return body


@dataclass(frozen=True, slots=True)
class Piece:
    """What one answer generated for its prompt (its first choice)."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str


def parse_completion(answer: Mapping[str, Any]) -> Piece:
    """A ``/v1/completions`` answer with ``return_token_ids``, read as a ``Piece``."""
    choices = answer.get("choices") or []
    if not choices:
        raise ValueError("the answer has no choices")
    choice = choices[0]
    reason = choice.get("finish_reason")
    if not isinstance(reason, str):
        raise ValueError(f"the answer has no finish_reason: {choice!r}")
    ids = choice.get("token_ids")
    if ids is None:
        if reason != ABORT:
            raise ValueError("the answer carries no token_ids (the engine ignored return_token_ids)")
        # The router aborted the request itself (``X-Misat-Abort: router``), so no output came back.
        ids = []
    lps = (choice.get("logprobs") or {}).get("token_logprobs")
    return Piece(text=str(choice.get("text") or ""), token_ids=[int(t) for t in ids],
                 logprobs=None if lps is None else [float(x) for x in lps], finish_reason=reason)


def join_pieces(pieces: Sequence[Piece]) -> Piece:
    """The answers of one generation (the first, then each resubmission after an abort) as one."""
    logprobs = None
    if any(p.logprobs is not None for p in pieces):
        logprobs = [x for p in pieces for x in (p.logprobs or [])]
    return Piece(text="".join(p.text for p in pieces), token_ids=[t for p in pieces for t in p.token_ids],
                 logprobs=logprobs, finish_reason=pieces[-1].finish_reason)


def engine_output(results: Sequence[Piece], want_logprobs: bool) -> InferenceEngineOutput:
    """One generation per prompt as SkyRL's ``InferenceEngineOutput``. As SkyRL does, the stop
    reason is vLLM's finish reason and the logprobs are given only when they were asked for."""
    return InferenceEngineOutput(
        responses=[r.text for r in results],
        response_ids=[list(r.token_ids) for r in results],
        stop_reasons=[r.finish_reason for r in results],
        response_logprobs=[list(r.logprobs or []) for r in results] if want_logprobs else None,
        prompt_logprobs=None,
        rollout_expert_indices=None,
    )


def split_session(request_payload: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """SkyRL's ``{"json": body, "headers": ...}`` payload as (session id, body without it). SkyRL
    puts the session in the body, and its own client moves it to a header before sending."""
    body = dict(request_payload.get("json") or {})
    return session_key(body.pop("session_id", None)), body


# ---- control (pure) -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ControlRequest:
    """One control call in the form SkyRL's ``RemoteInferenceClient`` sends to every server
    (``_call_all_servers(endpoint, json, method, params)``). A list in ``params`` becomes one
    query pair per item."""

    endpoint: str
    json: Any = None
    params: Mapping[str, str | list[str]] | None = None
    method: str = "POST"


def pause_request(mode: str = "keep", clear_cache: bool = False) -> ControlRequest:
    return ControlRequest("/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})


def resume_request() -> ControlRequest:
    return ControlRequest("/resume")


def sleep_request(level: int = 2, tags: Sequence[str] | None = None, *,
                  uses_lora_weight_sync: bool = False) -> ControlRequest:
    # SkyRL uses level 1 when it syncs only LoRA adapters: level 2 drops the base weights, and a
    # LoRA sync cannot bring them back.
    params: dict[str, str | list[str]] = {"level": str(1 if uses_lora_weight_sync else level)}
    if tags:
        params["tags"] = list(tags)
    return ControlRequest("/sleep", params=params)


def wake_up_request(tags: Sequence[str] | None = None) -> ControlRequest:
    return ControlRequest("/wake_up", params={"tags": list(tags)} if tags else {})


def reset_prefix_cache_request(reset_running_requests: bool = False) -> ControlRequest:
    return ControlRequest("/reset_prefix_cache", {"reset_running_requests": reset_running_requests})


def collective_rpc_request(method: str, kwargs: Mapping[str, Any] | None = None) -> ControlRequest:
    body: dict[str, Any] = {"method": method}
    if kwargs is not None:
        body["kwargs"] = dict(kwargs)
    return ControlRequest("/collective_rpc", body)


def update_weights_request(update_info: Mapping[str, Any]) -> ControlRequest:
    return ControlRequest("/update_weights", {"update_info": dict(update_info)})


def fetch_weights_request(target_version: int, sync_dir: str | None = None, uri: str | None = None) -> ControlRequest:
    body: dict[str, Any] = {"target_version": target_version}
    if sync_dir is not None:
        body["sync_dir"] = sync_dir
    if uri is not None:
        body["uri"] = uri
    return ControlRequest("/fetch_weights", body)


def load_lora_request(lora_name: str, lora_path: str) -> ControlRequest:
    return ControlRequest("/skyrl/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})


def unload_lora_request(lora_name: str) -> ControlRequest:
    return ControlRequest("/v1/unload_lora_adapter", {"lora_name": lora_name})


def world_size_request() -> ControlRequest:
    return ControlRequest("/get_world_size", {}, method="GET")


def init_transfer_request(payloads: Sequence[Mapping[str, Any]]) -> ControlRequest:
    """SkyRL's ``/init_weight_transfer_engine`` call, given one payload per engine
    (``init_info.for_servers(...)[i].to_api_payload()``). The pass-through sends one body to
    every engine, so this works only when all the payloads are equal."""
    if not payloads:
        raise ValueError("no engine to initialise a weight transfer on")
    first = payloads[0]
    differ = sorted({k for p in payloads for k in {*p, *first} if p.get(k) != first.get(k)})
    if differ:
        raise NotRoutable(f"/init_weight_transfer_engine: the payload differs per engine ({', '.join(differ)}) and the "
                          "router's pass-through sends one body to every engine; set the group up at each engine's "
                          "own address (or sync weights through checkpoint deltas)")
    return ControlRequest("/init_weight_transfer_engine", {"init_info": dict(first)})


def _flat_query(req: ControlRequest) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in (req.params or {}).items():
        if isinstance(value, str):
            out[key] = value
        elif len(value) == 1:
            out[key] = value[0]
        elif value:
            raise NotRoutable(f"{req.endpoint}: {len(value)} values of {key!r} ({', '.join(value)}); the router "
                              "passes a query through with one value per key, so send one call per value")
    return out


def control_actions(req: ControlRequest, pause_mode: PauseMode = PauseMode.KEEP) -> tuple[AdminAction, ...]:
    """What the router's admin API does, in order, for one of SkyRL's control calls. Raises
    ``NotRoutable`` for a call the router cannot carry. ``pause_mode`` is the router pause used
    for SkyRL's keep-mode pause: keep itself by default."""
    path, body, query = req.endpoint, req.json, _flat_query(req)
    if path == "/pause":
        mode = PauseMode(pause_mode if query.get("mode", "keep") == "keep" else query["mode"])
        # vLLM ignores clear_cache with keep (the frozen requests hold their blocks), and so does
        # the router's keep pause, which refuses a reset outright.
        clear = query.get("clear_cache", "false") == "true" and mode != PauseMode.KEEP
        return (PauseAction(mode, reset_prefix_cache=clear),)
    if path == "/resume":
        return (ResumeAction(reset_prefix_cache=False),)
    if path in ("/sleep", "/wake_up"):
        return (FanOutAction(EngineOp(path.removeprefix("/")), query),)
    if path == "/reset_prefix_cache":
        if isinstance(body, Mapping) and body.get("reset_running_requests"):
            # SkyRL's server reads the flag from the body, which the fan-out op does not send; the
            # pass-through does, and resets the router's prefix index as the op does. Stock vLLM
            # reads it from the query, so it goes there too.
            return (PassThroughAction(EngineCall(path, dict(body), req.method,
                                                 {**query, "reset_running_requests": "true"})),)
        return (FanOutAction(EngineOp.RESET_PREFIX_CACHE, query),)
    if path == "/collective_rpc" and isinstance(body, Mapping) and body.get("method") == "update_weights_ipc":
        raise NotRoutable("update_weights_ipc: CUDA IPC handles open only on the GPUs of the process that made "
                          "them (engines colocated with the trainer), not on engines behind a router")
    if path.startswith("/v1/"):
        raise NotRoutable(f"{path}: a /v1/ path; the router serves only /v1/completions and /v1/chat/completions "
                          "there, and its pass-through refuses /v1/ paths")
    return (PassThroughAction(EngineCall(path, body, req.method, query)),)


class ControlCallFailed(MisatClientError):
    """An engine did not answer a fanned-out control call with 2xx. SkyRL's client raises in
    the same case."""

    def __init__(self, what: str, result: EngineFanOut) -> None:
        self.result = result
        failed = result.failed()
        where = ", ".join(f"{e}: {r.error or f'status {r.status}'}" for e, r in failed.items()) or "no engine"
        super().__init__(f"{what} failed on {where}")


def per_engine(what: str, result: EngineFanOut) -> dict[str, dict[str, Any]]:
    """A fan-out as SkyRL's ``{server_url: {"status", "body"}}``, or ``ControlCallFailed``."""
    if not result.ok:
        raise ControlCallFailed(what, result)
    return {e: {"status": r.status, "body": r.body} for e, r in result.engines.items()}


def world_size(answers: Mapping[str, Mapping[str, Any]], data_parallel_size: int) -> tuple[int, int, int]:
    """(total world size, world size per engine, engines) from every engine's
    ``/get_world_size``. Counted as SkyRL counts: vLLM reports the world size of a whole
    deployment of ``data_parallel_size`` engines, so the total is per engine x deployments."""
    sizes: dict[str, int] = {}
    for engine, answer in answers.items():
        body = answer.get("body")
        size = body.get("world_size") if isinstance(body, Mapping) else None
        if not isinstance(size, int) or isinstance(size, bool):
            raise ValueError(f"{engine}: no world_size in /get_world_size's answer {body!r}")
        sizes[engine] = size
    if not sizes:
        raise ValueError("no engine answered /get_world_size")
    if len(set(sizes.values())) != 1:
        raise ValueError(f"the engines differ in world size: {sizes}")
    if len(sizes) % data_parallel_size:
        raise ValueError(f"{len(sizes)} engines do not divide into deployments of {data_parallel_size}")
    per = next(iter(sizes.values()))
    return per * (len(sizes) // data_parallel_size), per, len(sizes)


# ---- the client -------------------------------------------------------------------------------


class RouterInferenceClient:
    """SkyRL's ``InferenceEngineInterface`` through the router (see the module docstring).

    ``router_url``: the router's address (no ``/v1``). ``admin_token``: its admin token, used for
    the control calls. ``model_name``: the served model name (SkyRL's ``served_model_name`` or
    model path). ``rollout_class``: the class of prompts that carry a session id.
    ``single_turn_class``: the class of prompts without one. ``pause_mode``: the router pause
    used for SkyRL's keep-mode pause. With ``keep`` (the default), in-flight generations freeze
    on their engines and go on after the resume, as with SkyRL's own servers (the engines need
    vLLM's ``/pause``, served with ``VLLM_SERVER_DEV_MODE=1``, as SkyRL's do). With ``abort``,
    they end now and are sent again after the resume, so the sync does not wait for stragglers
    and SkyRL still gets whole responses. With ``wait``, they finish under the old weights, and
    ``pause_generation`` returns once none is left. ``data_parallel_size`` and
    ``uses_lora_weight_sync``: as in SkyRL's client.

    Like SkyRL's client, it can be pickled (SkyRL hands it to its Ray workers for weight syncs).
    The copy starts without HTTP connections or turn counts.
    """

    def __init__(
        self,
        router_url: str,
        admin_token: str,
        *,
        model_name: str,
        rollout_class: str = DEFAULT_ROLLOUT_CLASS,
        single_turn_class: str = DEFAULT_SINGLE_TURN_CLASS,
        pause_mode: PauseMode = PauseMode.KEEP,
        data_parallel_size: int = 1,
        uses_lora_weight_sync: bool = False,
        retry: HoldRetry | None = None,
        max_sessions: int = MAX_SESSIONS,
        timeout_s: float = GENERATION_TIMEOUT_S,
    ) -> None:
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        self.router_url = router_url.rstrip("/")
        self.model_name = model_name
        self.rollout_class = rollout_class
        self.single_turn_class = single_turn_class
        self.pause_mode = PauseMode(pause_mode)
        self.data_parallel_size = data_parallel_size
        self.uses_lora_weight_sync = uses_lora_weight_sync
        self.retry = retry
        self.max_sessions = max_sessions
        self.timeout_s = timeout_s
        self.admin = SyncAdminClient(self.router_url, admin_token)
        self._weight_version = 0
        self._world: tuple[int, int, int] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._sessions: OrderedDict[str, AsyncRolloutSession] = OrderedDict()

    # ---- HTTP and sessions ----

    def _client_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._http is None or self._http.closed or self._http_loop is not loop:
            # SkyRL drives one client from several event loops (an asyncio.run at set-up, then the
            # trainer's loop). An aiohttp session belongs to one loop, and so do the rollout
            # sessions built on it.
            self._sessions.clear()
            # No client-side cap on connections (open_http): the router holds what the pool cannot
            # take. SkyRL caps its own requests per engine only because nothing else does.
            self._http = open_http()
            self._http_loop = loop
        return self._http

    def _new_session(self, rollout_class: str, session_id: str | None) -> AsyncRolloutSession:
        return AsyncRolloutSession(self.router_url, rollout_class, session_id, http=self._client_session(),
                                   retry=self.retry, timeout_s=self.timeout_s)

    def _session(self, session_id: str | None) -> AsyncRolloutSession:
        if session_id is None:
            # A request on its own: the router ends a single-turn class's session when its request
            # ends, so there is nothing to remember or close here.
            return self._new_session(self.single_turn_class, None)
        self._client_session()  # first: a new event loop starts with no sessions
        session = self._sessions.get(session_id)
        if session is None:
            session = self._new_session(self.rollout_class, session_id)
            self._sessions[session_id] = session
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(session_id)
        return session

    def turns(self, session_id: Hashable) -> int:
        """The requests sent so far for ``session_id`` (0 when unknown or evicted)."""
        session = self._sessions.get(session_key(session_id) or "")
        return session.turns if session is not None else 0

    def engine_of(self, session_id: Hashable) -> str | None:
        """The engine that served ``session_id``'s latest turn, as the router named it."""
        session = self._sessions.get(session_key(session_id) or "")
        return session.engine if session is not None else None

    def _resolve_model(self, model: str | None, what: str) -> str:
        if model:
            return model
        if self.uses_lora_weight_sync:
            raise ValueError(f"{what}: name the LoRA adapter as `model` (uses_lora_weight_sync=True); the base "
                             "model would silently bypass it")
        return self.model_name

    # ---- data plane ----

    def get_endpoint_url(self) -> str:
        """The router: the OpenAI-compatible endpoint that SkyRL's external-agent generators use.
        Their requests are not labelled by this client."""
        return self.router_url

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput:
        """One ``/v1/completions`` per prompt, all at once, each labelled with its session."""
        model = self._resolve_model(model, "generate")
        if input_batch.get("prompts") is not None:
            raise ValueError("generate takes prompt_token_ids, not prompts (as SkyRL's RemoteInferenceClient); "
                             "send chat through chat_completion")
        prompts = input_batch.get("prompt_token_ids")
        if prompts is None:
            raise ValueError("generate needs prompt_token_ids")
        if input_batch.get("mm_features"):
            raise NotRoutable("mm_features: multi-modal features go to SkyRL's /inference/v1/generate; the router's "
                              "/v1/completions takes token ids only")
        params = input_batch.get("sampling_params") or {}
        sessions = input_batch.get("session_ids") or []
        bodies = [completion_body(model, ids, params, input_batch.get("cache_salt")) for ids in prompts]
        results = await asyncio.gather(*(
            self._generate_one(body, session_key(sessions[i]) if i < len(sessions) else None)
            for i, body in enumerate(bodies)))
        return engine_output(results, want_logprobs=params.get("logprobs") is not None)

    async def _generate_one(self, first: dict[str, Any], session_id: str | None) -> Piece:
        session = self._session(session_id)
        pieces = [parse_completion(await session.post(COMPLETIONS_PATH, first))]
        while pieces[-1].finish_reason == ABORT and len(pieces) <= MAX_RESUBMITS:
            # A pause aborted it. Send the same request again with its output so far, as the
            # session's next turn; the router holds it until the resume.
            body = continuation_body(first, [t for p in pieces for t in p.token_ids])
            if body is None:
                pieces[-1] = replace(pieces[-1], finish_reason="length")
                break
            pieces.append(parse_completion(await session.post(COMPLETIONS_PATH, body)))
        return join_pieces(pieces)

    async def chat_completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        """vLLM's chat completion through the router, as a turn of the body's ``session_id`` if it
        has one. An aborted answer is returned as it is."""
        return await self._openai_call(CHAT_PATH, request_payload, "chat_completion")

    async def completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        """vLLM's completion through the router, as for ``chat_completion``."""
        return await self._openai_call(COMPLETIONS_PATH, request_payload, "completion")

    async def _openai_call(self, path: str, request_payload: Mapping[str, Any], what: str) -> dict[str, Any]:
        session_id, body = split_session(request_payload)
        body["model"] = self._resolve_model(body.get("model"), what)
        return await self._session(session_id).post(path, body)

    async def render_chat_completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        raise NotRoutable("/v1/chat/completions/render: the router does not serve it; apply the chat template with "
                          "the tokenizer the generator already holds")

    async def finish_session(self, session_id: Hashable) -> None:
        """End the trajectory's router session now. Otherwise the router ends it after it has been
        idle long enough."""
        key = session_key(session_id)
        if key is None:
            return
        self._client_session()
        session = self._sessions.pop(key, None) or self._new_session(self.rollout_class, key)
        try:
            await session.end()
        except MisatClientError as exc:
            # SkyRL calls this from a trajectory's finally block, where raising would hide the
            # trajectory's own outcome. So, as in SkyRL's client, a failed end is logged, and the
            # router ends the session once it is idle.
            log.warning("finish_session %s: %s", key, exc)

    # ---- control plane ----

    async def _control(self, req: ControlRequest, *, weight_version: str | None = None) -> Any:
        result: Any = None
        for action in control_actions(req, self.pause_mode):
            # The sync admin client runs in a worker thread. Nothing gets bound to an event loop,
            # and the loop keeps serving generation meanwhile.
            result = await asyncio.to_thread(self._run_action, action, req.endpoint, weight_version)
        return result

    def _run_action(self, action: AdminAction, what: str, weight_version: str | None) -> Any:
        if isinstance(action, PauseAction):
            paused = self.admin.pause(action.mode, reset_prefix_cache=action.reset_prefix_cache)
            if action.mode == PauseMode.WAIT and paused.requests_in_flight:
                # vLLM's keep mode returns with nothing running, so the wait stand-in must too.
                self.admin.wait_idle()
            return paused
        if isinstance(action, ResumeAction):
            return self.admin.resume(reset_prefix_cache=action.reset_prefix_cache, weight_version=weight_version)
        if isinstance(action, FanOutAction):
            return per_engine(f"POST {what}", self.admin.engines(action.op, action.query))
        call = action.call
        return per_engine(f"{call.method} {call.path}", self.admin.engine_call(call, weight_version=weight_version))

    async def pause_generation(self, clear_cache: bool = False) -> PauseResult:
        """Hold new generation at the router. In-flight generations freeze until the resume, or
        are aborted to be sent again after it, or are waited for (``pause_mode``)."""
        result: PauseResult = await self._control(pause_request("keep", clear_cache))
        return result

    async def resume_generation(self) -> ResumeResult:
        """Release the held generation (SkyRL resets prefix caches itself, through
        ``reset_prefix_cache``)."""
        result: ResumeResult = await self._control(resume_request())
        return result

    async def sleep(self, level: int = 2, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """vLLM's ``/sleep`` on every engine. This does not hold the router's traffic, just as
        SkyRL's sleep does not hold its own."""
        return await self._control(sleep_request(level, tags, uses_lora_weight_sync=self.uses_lora_weight_sync))

    async def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """vLLM's ``/wake_up`` on every engine, with at most one tag per call."""
        return await self._control(wake_up_request(tags))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> dict[str, Any]:
        """Reset every engine's prefix cache and the router's prefix index."""
        return await self._control(reset_prefix_cache_request(reset_running_requests))

    async def sleep_for_weight_sync(self, offload_kv: bool = True) -> dict[str, Any]:
        return await self._control(
            collective_rpc_request("skyrl_sleep_for_weight_sync", {"offload_kv": offload_kv}))

    async def wake_for_weight_sync(self, tags: Sequence[str]) -> dict[str, Any]:
        return await self._control(
            collective_rpc_request("skyrl_wake_for_weight_sync", {"tags": list(tags)}))

    async def get_world_size(self) -> tuple[int, int]:
        """(total, per engine), from every engine's ``/get_world_size`` through the pass-through."""
        total, per, _ = await self._world_sizes()
        return total, per

    async def _world_sizes(self) -> tuple[int, int, int]:
        if self._world is None:
            self._world = world_size(await self._control(world_size_request()), self.data_parallel_size)
        return self._world

    async def init_weight_update_communicator(self, init_info: WeightSyncInitInfo) -> dict[str, Any]:
        """SkyRL's weight-transfer set-up on every engine. It can be routed only when every engine's
        payload is the same: a checkpoint-delta sync, or one broadcast deployment."""
        _, per, engines = await self._world_sizes()
        infos = init_info.for_servers(per, engines, dp_size=self.data_parallel_size)
        return await self._control(init_transfer_request([i.to_api_payload() for i in infos]))

    async def update_named_weights(self, request: Any) -> dict[str, Any]:
        """A checkpoint-delta ``update_info`` (a mapping) goes to vLLM's ``/update_weights``. A LoRA
        load request (with ``lora_path``) goes to the LoRA load: SkyRL's workers send one to any
        client other than its own ``RemoteInferenceClient``."""
        if isinstance(request, Mapping):
            return await self._control(update_weights_request(request))
        lora_path = getattr(request, "lora_path", None)
        if isinstance(lora_path, str) and lora_path:
            return await self.load_lora_adapter(str(getattr(request, "lora_name", "")), lora_path)
        raise TypeError(f"update_named_weights takes an update_info mapping or a LoRA load request, "
                        f"got {type(request).__name__}")

    async def fetch_weights(self, target_version: int, sync_dir: str | None = None,
                            uri: str | None = None) -> dict[str, Any]:
        return await self._control(fetch_weights_request(target_version, sync_dir, uri))

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> dict[str, Any]:
        return await self._control(
            collective_rpc_request("skyrl_start_weight_update", {"is_checkpoint_format": is_checkpoint_format}))

    async def update_weights_nccl(self, update_info: Mapping[str, Any]) -> dict[str, Any]:
        """Routable, since the body is the same for every engine, but only after a weight-transfer
        group that ``init_weight_update_communicator`` could set up."""
        return await self._control(
            collective_rpc_request("update_weights_nccl", {"update_info": dict(update_info)}))

    async def update_weights_ipc(self, update_info: Mapping[str, Any]) -> dict[str, Any]:
        return await self._control(
            collective_rpc_request("update_weights_ipc", {"update_info": dict(update_info)}))

    async def finish_weight_update(self) -> dict[str, Any]:
        """Also records the weight version this sync produces for every engine that answered 2xx
        (visible in the router's ``/status``). SkyRL counts that version with
        ``increment_weight_version`` once the sync returns."""
        return await self._control(collective_rpc_request("skyrl_finish_weight_update"),
                                   weight_version=str(self._weight_version + 1))

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        return await self._control(load_lora_request(lora_name, lora_path))

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return await self._control(unload_lora_request(lora_name))

    @property
    def weight_version(self) -> int:
        """The weight syncs so far, as SkyRL counts them (its prefix-cache salt)."""
        return self._weight_version

    def increment_weight_version(self) -> None:
        self._weight_version += 1

    # ---- lifecycle ----

    async def teardown(self) -> None:
        """Forget the trajectories and close this client's HTTP connections."""
        self._sessions.clear()
        if self._http is not None and self._http_loop is asyncio.get_running_loop():
            await self._http.close()
        self._http = None
        self._http_loop = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_http=None, _http_loop=None, _sessions=OrderedDict())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
