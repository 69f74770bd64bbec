"""vLLM-compatible HTTP server over the engine model (aiohttp).

Serves what the router and the benchmarks use from a real vLLM OpenAI server
(docs/real-vllm.md), with vLLM's paths, body shapes and errors:
``/v1/completions``, ``/v1/chat/completions`` (streaming with
``stream_options.include_usage``; ``return_token_ids``; ``n`` > 1 as vLLM's
parallel sampling, batched prompts, logprobs, ``return_tokens_as_token_ids``),
``/tokenize``, ``/v1/models``, ``/health``, ``/load``, ``/version``,
``POST /reset_prefix_cache`` and ``/metrics``; vLLM's engine control
(``/pause``, ``/resume``, ``/is_paused``, ``/abort_requests``, ``/sleep``,
``/wake_up``, ``/is_sleeping``, ``/collective_rpc``) with its abort answers
(partial output, ``finish_reason: "abort"``), its weight endpoints
(``/update_weights`` ..., ``GET /weight_info``: the weight version) and AReaL's
``/areal_*`` ones; plus the simulator's own ``/misat/keep_up`` (JSON: whether the
engine keeps pace with the wall clock, ``misat_sim.engine_loop``). Differences
from vLLM are listed in docs/simulator.md (for instance
``usage.prompt_tokens_details.cached_tokens`` is always present, where vLLM
needs ``--enable-prompt-tokens-details``).

``create_app(config)`` builds the app; ``start_server(config, host, port)``
runs one on a port (0 picks a free one) and returns its base URL and a stop
function, so one process can host several engines; ``main(argv)`` is the
command line (``python -m misat_sim.server`` or ``misat sim-engine``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from aiohttp import web
from pydantic import BaseModel, ValidationError

from misat_sim.config import DEFAULT_TIME_SCALE, SimEngineConfig
from misat_sim.engine import FinishedRequest, SimEngine
from misat_sim.engine_loop import EngineLoop, RequestStream, TokenDelta
from misat_sim.logprobs import LogprobModel, seed_for
from misat_sim.metrics import EngineMetrics
from misat_sim.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    check_lengths,
    check_simulated,
    model_not_found,
    requested_logprobs,
)
from misat_sim.profiles import PROFILES
from misat_sim.request import FIRST_REGULAR_TOKEN_ID, FinishReason
from misat_sim.tokenizer import WordTokenizer, render_chat

SIM_VERSION: str = "0.32.0+misat-sim"
"""Reported by ``/version``: the vLLM version whose surface is reproduced."""
KEEP_UP_PATH: str = "/misat/keep_up"
"""The simulator's keep-up figures as JSON (not a vLLM endpoint)."""
LISTEN_BACKLOG = 2048
"""Listen queue length: uvicorn's default, which vLLM's API server runs with."""


PAUSE_MODES = frozenset({"abort", "wait", "keep"})
"""vLLM's ``PauseMode`` values (``/pause?mode=``, ``/sleep?mode=``)."""
WAKE_UP_TAGS = frozenset({"weights", "kv_cache"})
"""vLLM's ``/wake_up?tags=`` values."""
LOGPROB_FLOOR: float = -9999.0
"""vLLM clamps reported logprobs here (``-inf`` is not JSON)."""


@dataclass(eq=False)
class _Child:
    """One sample of one prompt: an engine request (a child of vLLM's parallel-sampling parent)."""

    index: int
    """Choice index: prompt index x n + sample, vLLM's order."""
    sample: int
    parent_id: str
    request_id: str
    prompt_ids: list[int]
    stream: RequestStream
    logprobs: LogprobModel | None
    emitted: int = 0
    """Output tokens already rendered for the client."""
    text_offset: int = 0
    finished: FinishedRequest | None = None


@dataclass
class ServerState:
    """Everything the handlers need, built once per app."""

    config: SimEngineConfig
    model_name: str
    loop: EngineLoop
    tokenizer: WordTokenizer
    created: int
    live: dict[str, _Child] = field(default_factory=dict)
    """Children whose handler is still answering (the work a pause may abort)."""
    running: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while the engine schedules new work (cleared by a pause or a sleep)."""
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while nothing is live (what ``/pause?mode=wait`` waits for)."""
    waiting: int = 0
    """Requests accepted while paused or asleep, waiting to be scheduled."""
    paused: bool = False
    sleeping: bool = False
    sleep_level: int | None = None
    weight_version: str | None = None
    """Reported by ``GET /weight_info`` (vLLM's): set by ``/update_weight_version``,
    ``/finish_weight_update`` with a version, and AReaL's ``/areal_update_weights`` (its path)."""
    weight_updates: int = 0
    rpc_calls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.running.set()
        self.idle.set()

    @property
    def engine(self) -> SimEngine:
        """The engine model."""
        return self.loop.engine

    def track(self, child: _Child) -> None:
        self.live[child.request_id] = child
        self.idle.clear()

    def untrack(self, child: _Child) -> None:
        self.live.pop(child.request_id, None)
        if not self.live:
            self.idle.set()


STATE: web.AppKey[ServerState] = web.AppKey("sim_state", ServerState)


def create_app(config: SimEngineConfig) -> web.Application:
    """A vLLM-compatible app over a fresh engine model built from ``config``."""
    engine = SimEngine(config)
    metrics = EngineMetrics(engine, config.model_name(), config.engine_index)
    state = ServerState(
        config=config,
        model_name=config.model_name(),
        loop=EngineLoop(engine, metrics, config.time_scale),
        tokenizer=WordTokenizer(engine.limits.vocab_size, engine.limits.eos_token_id),
        created=int(time.time()),
    )
    app = web.Application(middlewares=[_error_middleware])
    app[STATE] = state

    async def engine_loop_ctx(_app: web.Application) -> AsyncIterator[None]:
        await state.loop.start()
        yield
        await state.loop.stop()

    app.cleanup_ctx.append(engine_loop_ctx)
    app.router.add_get("/health", _health)
    app.router.add_get("/ping", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/load", _load)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get(KEEP_UP_PATH, _keep_up)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    # vLLM's engine control (dev-mode routes there; always served here).
    app.router.add_post("/pause", _pause)
    app.router.add_post("/resume", _resume)
    app.router.add_get("/is_paused", _is_paused)
    app.router.add_post("/abort_requests", _abort_requests)
    app.router.add_post("/sleep", _sleep)
    app.router.add_post("/wake_up", _wake_up)
    app.router.add_get("/is_sleeping", _is_sleeping)
    app.router.add_post("/collective_rpc", _collective_rpc)
    app.router.add_post("/init_weight_transfer_engine", _init_weight_transfer)
    app.router.add_post("/start_weight_update", _start_weight_update)
    app.router.add_post("/update_weights", _update_weights)
    app.router.add_post("/finish_weight_update", _finish_weight_update)
    app.router.add_post("/update_weight_version", _update_weight_version)
    app.router.add_get("/weight_info", _weight_info)
    # AReaL's vLLM server extension (areal/engine/vllm_ext/areal_vllm_server.py).
    app.router.add_post("/areal_update_weights", _areal_update_weights)
    app.router.add_post("/areal_update_weights_xccl", _areal_update_weights_xccl)
    app.router.add_post("/areal_init_weights_update_group", _areal_ack)
    app.router.add_post("/areal_set_update_weight_meta", _areal_ack)
    app.router.add_post("/areal_pause_generation", _areal_pause)
    app.router.add_post("/areal_continue_generation", _areal_continue)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    return app


# --- edge: errors ------------------------------------------------------------------


@web.middleware
async def _error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status)


async def _read_object(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"Invalid JSON body: {e}") from None
    if not isinstance(raw, dict):
        raise ApiError("The request body must be a JSON object.")
    return raw


async def _parse(request: web.Request, model: type[BaseModel]) -> Any:
    raw = await _read_object(request)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise ApiError(
            f"{loc}: {first.get('msg')}" if loc else str(first.get("msg")), param=loc or None
        ) from None


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise model_not_found(name)


# --- small endpoints -------------------------------------------------------------


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": SIM_VERSION})


async def _load(request: web.Request) -> web.Response:
    return web.json_response({"server_load": request.app[STATE].loop.server_load})


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "vllm",
        "root": state.model_name,
        "parent": None,
        "max_model_len": state.engine.limits.max_model_len,
        "permission": [],
    }
    return web.json_response({"object": "list", "data": [card]})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].loop.metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _keep_up(request: web.Request) -> web.Response:
    loop = request.app[STATE].loop
    body: dict[str, Any] = {"engine_index": loop.metrics.engine_index, "time_scale": loop.time_scale,
                            "delivery_slice_s": loop.delivery_slice_s, **loop.keep_up().as_dict()}
    return web.json_response(body)


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    # vLLM reads reset_running_requests from the query (SkyRL's server from the body: not served here).
    running = _query_bool(request, "reset_running_requests", False)
    ok = request.app[STATE].loop.reset_prefix_cache(running)
    # vLLM answers 200 either way, with {"success": ...} (0.32; older releases send no body); the
    # header says the same for clients that read no body.
    return web.json_response({"success": ok}, headers={"X-Prefix-Cache-Reset": "true" if ok else "false"})


async def _tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body: TokenizeRequest = await _parse(request, TokenizeRequest)
    _check_model(state, body.model)
    if body.messages is not None:
        text = render_chat(body.messages)
    elif body.prompt is not None:
        text = body.prompt
    else:
        raise ApiError("Either `prompt` or `messages` is required.", param="prompt")
    ids = state.tokenizer.encode(text)
    strs = [state.tokenizer.token_str(t) for t in ids] if body.return_token_strs else None
    return web.json_response(
        {
            "count": len(ids),
            "max_model_len": state.engine.limits.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
    )


# --- generation ----------------------------------------------------------------------


@dataclass
class _Spec:
    """What one generation request asks for, validated."""

    chat: bool
    prompts: list[list[int]]
    max_tokens: list[int]
    n: int
    logprobs: int | None
    """Top logprobs per token (None: no logprobs)."""
    as_token_ids: bool


def _prompt_ids(state: ServerState, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return state.tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        vocab = state.engine.limits.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(f"Token id {bad} is out of vocabulary", param="prompt")
        return list(prompt)
    raise ApiError("The prompt cannot be empty.", param="prompt")


def _completion_prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    """One prompt (text or token ids) or a batch of them (a list of texts or of id lists)."""
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return [_prompt_ids(state, p) for p in prompt]
    return [_prompt_ids(state, prompt)]


def _usage(children: list[_Child], spec: _Spec) -> dict[str, Any]:
    # vLLM counts each prompt once (not once per sample) and sums the samples' outputs.
    n_prompt = sum(len(p) for p in spec.prompts)
    n_out = sum(c.finished.num_output_tokens for c in children if c.finished is not None)
    cached = sum(c.finished.num_cached_tokens for c in children if c.finished is not None and c.sample == 0)
    return {
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + n_out,
        "completion_tokens": n_out,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _submit_children(
    state: ServerState, body: CompletionRequest | ChatCompletionRequest, spec: _Spec
) -> tuple[str, list[_Child]]:
    """vLLM's parallel sampling: each prompt's n samples are n engine requests (children), so the
    later ones find the prompt in the prefix cache; a seeded parent gives child j seed + j."""
    rid = uuid.uuid4().hex
    greedy = body.temperature == 0
    vocab = state.engine.limits.vocab_size
    children: list[_Child] = []
    for i, ids in enumerate(spec.prompts):
        for j in range(spec.n):
            seed = None if body.seed is None else body.seed + j
            child_id = f"{j}_{rid}-{i}" if spec.n > 1 or len(spec.prompts) > 1 else rid
            stream = state.loop.submit(
                child_id, ids, spec.max_tokens[i], ignore_eos=body.ignore_eos, sample_seed=seed,
                greedy=greedy, stream=body.stream,
            )
            model = None
            if spec.logprobs is not None:
                model = LogprobModel(seed_for(state.config.seed, ids, j if seed is None else seed), vocab,
                                     greedy=greedy, top_k=body.top_k)
            child = _Child(index=i * spec.n + j, sample=j, parent_id=rid, request_id=child_id,
                           prompt_ids=ids, stream=stream, logprobs=model)
            children.append(child)
            state.track(child)
    return rid, children


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body: CompletionRequest = await _parse(request, CompletionRequest)
    _check_model(state, body.model)
    _check_simulated(state, body)
    prompts = _completion_prompts(state, body.prompt)
    limit = state.engine.limits.max_model_len
    max_tokens = [check_lengths(len(p), body.max_tokens, limit) for p in prompts]
    spec = _Spec(chat=False, prompts=prompts, max_tokens=max_tokens,
                 n=body.n, logprobs=requested_logprobs(body), as_token_ids=bool(body.return_tokens_as_token_ids))
    return await _generate(request, state, body, spec)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
    _check_model(state, body.model)
    if not body.messages:
        raise ApiError("messages must not be empty", param="messages")
    _check_simulated(state, body)
    ids = state.tokenizer.encode(render_chat(body.messages))
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = check_lengths(len(ids), requested, state.engine.limits.max_model_len)
    spec = _Spec(chat=True, prompts=[ids], max_tokens=[max_tokens], n=body.n,
                 logprobs=requested_logprobs(body), as_token_ids=bool(body.return_tokens_as_token_ids))
    return await _generate(request, state, body, spec)


def _check_simulated(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> None:
    check_simulated(body, first_regular_id=FIRST_REGULAR_TOKEN_ID, eos_token_id=state.engine.limits.eos_token_id)


async def _generate(
    request: web.Request,
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    spec: _Spec,
) -> web.StreamResponse:
    # A paused or sleeping vLLM engine accepts requests and schedules them on resume / wake-up.
    if not state.running.is_set():
        state.waiting += 1
        try:
            await state.running.wait()
        finally:
            state.waiting -= 1
    rid, children = _submit_children(state, body, spec)
    try:
        if body.stream:
            return await _stream_response(request, state, body, spec, rid, children)
        return await _full_response(state, body, spec, rid, children)
    finally:
        for c in children:
            state.untrack(c)
            if c.stream.finished is None:
                # Client gone (handler cancelled or write failed): free the request's KV now.
                state.loop.abort(c.request_id)


def _token_text(state: ServerState, token_id: int, first: bool, as_ids: bool) -> str:
    """A token as vLLM's logprobs name it: ``token_id:<id>``, or its text (spaced as in ``text``)."""
    if as_ids:
        return f"token_id:{token_id}"
    word = state.tokenizer.token_str(token_id)
    return word if first or not word else " " + word


def _logprobs_json(state: ServerState, spec: _Spec, child: _Child, token_ids: list[int]) -> dict[str, Any]:
    """vLLM's logprobs object for ``token_ids``, the next tokens of ``child`` (advances it)."""
    model = child.logprobs
    assert model is not None and spec.logprobs is not None
    k, as_ids = spec.logprobs, spec.as_token_ids
    if spec.chat:
        content = []
        for t in token_ids:
            pos = model.next(t)
            first = child.emitted == 0
            tok = _token_text(state, t, first, as_ids)
            top = []
            for tid, lp in pos.ranked(k)[:k]:
                text = _token_text(state, tid, first, as_ids)
                top.append({"token": text, "logprob": max(lp, LOGPROB_FLOOR), "bytes": list(text.encode())})
            content.append({"token": tok, "logprob": max(pos.logprob, LOGPROB_FLOOR),
                            "bytes": list(tok.encode()), "top_logprobs": top})
            child.emitted += 1
        return {"content": content}
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []
    for t in token_ids:
        pos = model.next(t)
        first = child.emitted == 0
        tok = _token_text(state, t, first, as_ids)
        tokens.append(tok)
        token_logprobs.append(max(pos.logprob, LOGPROB_FLOOR))
        top_logprobs.append({_token_text(state, tid, first, as_ids): max(lp, LOGPROB_FLOOR)
                             for tid, lp in pos.ranked(k)})
        text_offset.append(child.text_offset)
        child.text_offset += len(tok)
        child.emitted += 1
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


async def _full_response(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    spec: _Spec,
    rid: str,
    children: list[_Child],
) -> web.Response:
    for c in children:
        while True:
            item = await c.stream.queue.get()
            if isinstance(item, FinishedRequest):
                c.finished = item
                break
    choices = []
    for c in children:
        f = c.finished
        assert f is not None
        text = state.tokenizer.decode(f.output_token_ids)
        choice: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": f.finish_reason.value,
                                  "stop_reason": None}
        if c.logprobs is not None:
            choice["logprobs"] = _logprobs_json(state, spec, c, f.output_token_ids)
        if spec.chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
        if body.return_token_ids:
            choice["token_ids"] = list(f.output_token_ids)
            if not spec.chat:
                choice["prompt_token_ids"] = c.prompt_ids
        choices.append(choice)
    out: dict[str, Any] = {
        "id": f"{'chatcmpl' if spec.chat else 'cmpl'}-{rid}",
        "object": "chat.completion" if spec.chat else "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": _usage(children, spec),
    }
    if body.return_token_ids and len(spec.prompts) == 1:
        out["prompt_token_ids"] = spec.prompts[0]
    return web.json_response(out)


async def _pump(child: _Child, merged: asyncio.Queue[tuple[_Child, TokenDelta | FinishedRequest]]) -> None:
    while True:
        item = await child.stream.queue.get()
        merged.put_nowait((child, item))
        if isinstance(item, FinishedRequest):
            return


async def _stream_response(
    request: web.Request,
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    spec: _Spec,
    rid: str,
    children: list[_Child],
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chat = spec.chat
    cid = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    async def send(choices: list[dict[str, Any]], **extra: Any) -> None:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client disconnected")
        chunk = {"id": cid, "object": obj, "created": created, "model": state.model_name, "choices": choices}
        chunk.update(extra)
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    merged: asyncio.Queue[tuple[_Child, TokenDelta | FinishedRequest]] = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(c, merged)) for c in children]
    try:
        with contextlib.suppress(ConnectionResetError):
            if chat:
                for c in children:
                    await send([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}])
            remaining = len(children)
            while remaining:
                c, item = await merged.get()
                if isinstance(item, TokenDelta):
                    first = c.emitted == 0
                    text = state.tokenizer.decode_delta(item.token_ids, first)
                    choice: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": None}
                    if chat:
                        choice["delta"] = {"content": text}
                    else:
                        choice["text"] = text
                    extra: dict[str, Any] = {}
                    if body.return_token_ids:
                        choice["token_ids"] = item.token_ids
                        if first:
                            extra["prompt_token_ids"] = c.prompt_ids
                            if not chat:
                                choice["prompt_token_ids"] = c.prompt_ids
                    if c.logprobs is not None:
                        choice["logprobs"] = _logprobs_json(state, spec, c, item.token_ids)
                    else:
                        c.emitted += len(item.token_ids)
                    await send([choice], **extra)
                    continue
                c.finished = item
                remaining -= 1
                last: dict[str, Any] = {"index": c.index, "logprobs": None,
                                        "finish_reason": item.finish_reason.value, "stop_reason": None}
                if chat:
                    last["delta"] = {}
                else:
                    last["text"] = ""
                await send([last])
            if include_usage:
                await send([], usage=_usage(children, spec))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
    finally:
        for p in pumps:
            p.cancel()
    return resp


# --- engine control: pause, sleep, abort, weights ------------------------------------------


def _abort_child(state: ServerState, child: _Child) -> bool:
    """Abort one child as vLLM's pause/abort does: it answers with what it generated so far and
    ``finish_reason: "abort"`` (a stream gets its undelivered tokens, then the finish)."""
    rs = child.stream
    if rs.finished is not None or child.request_id not in state.loop.streams:
        return False  # finished (perhaps not yet read by its handler): nothing to abort
    req = state.engine.get_request(child.request_id)
    out = list(req.materialize_outputs()) if req is not None else []
    state.loop.abort(child.request_id)
    now = state.loop.now()
    f = FinishedRequest(
        request_id=child.request_id,
        finish_reason=FinishReason.ABORT,
        num_prompt_tokens=len(child.prompt_ids),
        num_cached_tokens=max(0, req.num_cached_tokens) if req is not None else 0,
        output_token_ids=out,
        num_output_tokens=len(out),
        arrival_time=req.arrival_time if req is not None else now,
        first_scheduled_time=req.first_scheduled_time if req is not None else None,
        first_token_time=req.first_token_time if req is not None else None,
        finish_time=now,
        num_preemptions=req.num_preemptions if req is not None else 0,
    )
    if rs.streaming and len(out) > rs.sent:
        rs.queue.put_nowait(TokenDelta(out[rs.sent :]))
        rs.sent = len(out)
    rs.finished = f
    rs.queue.put_nowait(f)
    return True


def _abort(state: ServerState, parent_ids: set[str] | None = None) -> int:
    """Abort the live children (of ``parent_ids`` only, when given); how many were aborted."""
    return sum(
        _abort_child(state, c)
        for c in list(state.live.values())
        if parent_ids is None or c.parent_id in parent_ids
    )


def _query_bool(request: web.Request, name: str, default: bool) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return default
    if raw.lower() in ("true", "1", "yes"):
        return True
    if raw.lower() in ("false", "0", "no"):
        return False
    raise ApiError(f"{name} must be true or false, got {raw!r}", param=name)


async def _pause_engine(state: ServerState, mode: str, clear_cache: bool) -> int:
    """vLLM's ``pause_generation``: new work waits; in flight is aborted (``abort``), awaited
    (``wait``) or frozen in place until ``/resume`` (``keep``); then the prefix cache is cleared if
    asked (not with ``keep``, as in vLLM: the frozen requests hold their blocks). Returns the
    aborted children."""
    if mode not in PAUSE_MODES:
        raise ApiError(f"mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}", param="mode")
    state.paused = True
    state.running.clear()
    if mode == "keep":
        state.loop.freeze()
        return 0
    aborted = 0
    if mode == "abort":
        aborted = _abort(state)
    else:
        await state.idle.wait()
    if clear_cache:
        state.loop.reset_prefix_cache()
    return aborted


def _resume_engine(state: ServerState) -> None:
    state.paused = False
    state.loop.thaw()
    if not state.sleeping:
        state.running.set()


async def _pause(request: web.Request) -> web.Response:
    state = request.app[STATE]
    mode = request.query.get("mode", "abort")
    if _query_bool(request, "wait_for_inflight_requests", False):
        mode = "wait"  # vLLM's deprecated spelling of mode=wait
    await _pause_engine(state, mode, _query_bool(request, "clear_cache", True))
    return web.json_response({"status": "paused"})


async def _resume(request: web.Request) -> web.Response:
    _resume_engine(request.app[STATE])
    return web.json_response({"status": "resumed"})


async def _is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[STATE].paused})


async def _abort_requests(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw = await _json_object(request)
    ids = raw.get("request_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
        raise ApiError("request_ids must be a list of strings", param="request_ids")
    # The ids clients see are the response ids (``cmpl-<id>``, ``chatcmpl-<id>``).
    parents = {i.split("-", 1)[1] if i.startswith(("cmpl-", "chatcmpl-")) else i for i in ids} if ids else None
    return web.json_response({"status": "aborted", "aborted": _abort(state, parents)})


async def _sleep(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw_level = request.query.get("level", "1")
    if raw_level not in ("0", "1", "2"):
        raise ApiError(f"level must be 0, 1 or 2, got {raw_level!r}", param="level")
    level = int(raw_level)
    mode = request.query.get("mode", "abort")
    if mode == "keep" and level >= 1:
        # Frozen requests hold their KV, which level >= 1 discards: only level 0 keeps them whole.
        raise ApiError("mode 'keep' with sleep level 1 or 2 is not simulated (the frozen requests' KV "
                       "would be discarded); use level 0, or mode 'abort' or 'wait'", param="mode")
    # vLLM's sleep pauses the scheduler first (mode as for /pause); level >= 1 discards the KV cache.
    await _pause_engine(state, mode, clear_cache=level >= 1)
    state.sleeping = True
    state.sleep_level = level
    return web.Response(status=200)


async def _wake_up(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tags = request.query.getall("tags", [])
    unknown = sorted(set(tags) - WAKE_UP_TAGS)
    if unknown:
        raise ApiError(f"unknown wake-up tags {unknown}; known: {sorted(WAKE_UP_TAGS)}", param="tags")
    # Waking only the weights leaves the KV cache asleep: the engine cannot schedule yet.
    if not tags or "kv_cache" in tags:
        state.sleeping = False
        state.sleep_level = None
        _resume_engine(state)
    return web.Response(status=200)


async def _is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": request.app[STATE].sleeping})


async def _json_object(request: web.Request) -> dict[str, Any]:
    """An optional JSON-object body (control endpoints): none is ``{}``."""
    return await _read_object(request) if request.can_read_body else {}


async def _collective_rpc(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw = await _json_object(request)
    method = raw.get("method")
    if not isinstance(method, str) or not method:
        raise ApiError("Missing 'method' in request body", param="method")
    state.rpc_calls.append(method)
    # One simulated worker, which has nothing to return.
    return web.json_response({"results": [None]})


def _set_version(state: ServerState, version: object, param: str) -> None:
    if not isinstance(version, str) or not version:
        raise ApiError(f"{param} must be a non-empty string", param=param)
    state.weight_version = version


async def _init_weight_transfer(request: web.Request) -> web.Response:
    raw = await _json_object(request)
    if raw.get("init_info") is None:
        raise ApiError("Missing 'init_info' in request body", param="init_info")
    return web.json_response({"message": "Weight transfer initialized"})


async def _start_weight_update(request: web.Request) -> web.Response:
    return web.json_response({"message": "Weight update started"})


async def _update_weights(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw = await _json_object(request)
    if raw.get("update_info") is None:
        raise ApiError("Missing 'update_info' in request body", param="update_info")
    state.weight_updates += 1
    return web.json_response({"message": "Weights updated"})


async def _finish_weight_update(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw = await _json_object(request)
    if raw.get("weight_version") is not None:
        _set_version(state, raw["weight_version"], "weight_version")
    return web.json_response({"message": "Weight update finished"})


async def _update_weight_version(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw = await _json_object(request)
    _set_version(state, raw.get("new_version"), "new_version")
    return web.json_response({"success": True, "new_version": state.weight_version})


async def _weight_info(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[STATE].weight_version})


def _areal_ok(message: str) -> web.Response:
    return web.json_response({"success": True, "message": message})


async def _areal_update_weights(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw = await _json_object(request)
    path = raw.get("model_path")
    if not isinstance(path, str) or not path:
        raise ApiError("model_path must be a non-empty string", param="model_path")
    # AReaL's server aborts in-flight work and clears caches around a disk update, then resumes.
    await _pause_engine(state, "abort", clear_cache=True)
    state.weight_updates += 1
    state.weight_version = path
    _resume_engine(state)
    return _areal_ok("TP rank: 0 success\n")


async def _areal_update_weights_xccl(request: web.Request) -> web.Response:
    state = request.app[STATE]
    await _pause_engine(state, "abort", clear_cache=True)
    state.weight_updates += 1
    _resume_engine(state)
    return _areal_ok("TP rank: 0 success\n")


async def _areal_ack(request: web.Request) -> web.Response:
    await _json_object(request)
    return _areal_ok("TP rank: 0 success\n")


async def _areal_pause(request: web.Request) -> web.Response:
    await _pause_engine(request.app[STATE], "abort", clear_cache=True)
    return _areal_ok("Generation paused and all requests aborted")


async def _areal_continue(request: web.Request) -> web.Response:
    _resume_engine(request.app[STATE])
    return _areal_ok("Generation continued")


# --- running servers -------------------------------------------------------------------


@dataclass
class RunningServer:
    """A started server: where it listens and how to stop it."""

    base_url: str
    app: web.Application
    stop: Callable[[], Awaitable[None]]


async def start_server(config: SimEngineConfig, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Start one simulated engine on ``host:port`` (0 = a free port) in this event loop."""
    app = create_app(config)
    # Handler cancellation makes a client disconnect cancel a non-streaming handler,
    # whose cleanup aborts the request and frees its KV blocks (as vLLM does).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG)
    await site.start()
    # The bound port when asked for port 0; aiohttp keeps the asyncio.Server private.
    server = cast(asyncio.Server | None, site._server)
    sockets = server.sockets if server is not None else []
    bound_port = sockets[0].getsockname()[1] if sockets else port
    url_host = f"[{host}]" if ":" in host else host

    async def stop() -> None:
        await runner.cleanup()

    return RunningServer(base_url=f"http://{url_host}:{bound_port}", app=app, stop=stop)


def build_parser() -> argparse.ArgumentParser:
    """The ``sim-engine`` command line (vLLM's flag names where they exist)."""
    p = argparse.ArgumentParser(prog="misat sim-engine", description="Simulated vLLM engine server.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--profile", default="qwen30b-a3b-h100", choices=sorted(PROFILES),
                   help="engine profile: model, GPU and step-time constants (misat_sim.profiles)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", default=None, help="model name served (default: the profile's)")
    p.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE,
                   help="modelled seconds per wall second")
    p.add_argument("--seed", type=int, default=0, help="seed of generated tokens and logprobs")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks (default: the profile's)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the profile's)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="most running requests (default: the profile's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: the profile's)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit in tokens (default: the profile's)")
    p.add_argument("--length-scale", type=float, default=None,
                   help="factor on KV capacity and max_model_len (default: the profile's)")
    p.add_argument("--engine-index", type=int, default=0, help="the engine label of its metrics")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    return p


def config_from_args(args: argparse.Namespace) -> SimEngineConfig:
    """The engine config the parsed flags describe."""
    return SimEngineConfig(
        profile=args.profile,
        served_model_name=args.served_model_name,
        seed=args.seed,
        time_scale=args.time_scale,
        length_scale=args.length_scale,
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        engine_index=args.engine_index,
    )


def main(argv: list[str] | None = None) -> int:
    """Run one simulated engine until interrupted."""
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        config.resolve()
    except (ValueError, ValidationError) as e:
        print(f"error: {e}")
        return 2
    app = create_app(config)
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, access_log=None,
                backlog=LISTEN_BACKLOG, print=lambda *_: None)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
