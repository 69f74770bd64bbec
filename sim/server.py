"""vLLM-compatible HTTP server over the engine model (aiohttp).

Serves what the router and the benchmarks use from a real vLLM OpenAI server
(docs/real-vllm.md), with vLLM's paths, body shapes and errors:
``/v1/completions``, ``/v1/chat/completions`` (streaming with
``stream_options.include_usage``; ``return_token_ids``), ``/tokenize``,
``/v1/models``, ``/health``, ``/load``, ``/version``, ``POST /reset_prefix_cache``
and ``/metrics``; plus the simulator's own ``/misat/keep_up`` (JSON: whether the
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
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from pydantic import BaseModel, ValidationError

from misat_sim.config import DEFAULT_TIME_SCALE, SimEngineConfig
from misat_sim.engine import FinishedRequest, SimEngine
from misat_sim.engine_loop import EngineLoop, RequestStream, TokenDelta
from misat_sim.metrics import EngineMetrics
from misat_sim.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    check_lengths,
    model_not_found,
)
from misat_sim.profiles import PROFILES
from misat_sim.tokenizer import WordTokenizer, render_chat

SIM_VERSION: str = "0.32.0+misat-sim"
"""Reported by ``/version``: the vLLM version whose surface is reproduced."""
KEEP_UP_PATH: str = "/misat/keep_up"
"""The simulator's keep-up figures as JSON (not a vLLM endpoint)."""
LISTEN_BACKLOG = 2048
"""Listen queue length: uvicorn's default, which vLLM's API server runs with."""


@dataclass
class ServerState:
    """Everything the handlers need, built once per app."""

    config: SimEngineConfig
    model_name: str
    loop: EngineLoop
    tokenizer: WordTokenizer
    created: int

    @property
    def engine(self) -> SimEngine:
        """The engine model."""
        return self.loop.engine


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


async def _parse(request: web.Request, model: type[BaseModel]) -> Any:
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"Invalid JSON body: {e}") from None
    if not isinstance(raw, dict):
        raise ApiError("The request body must be a JSON object.")
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
    ok = request.app[STATE].engine.reset_prefix_cache()
    # vLLM answers 200 either way (a refused reset is only logged); the header tells which.
    return web.Response(status=200, headers={"X-Prefix-Cache-Reset": "true" if ok else "false"})


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


def _completion_prompt_ids(state: ServerState, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return state.tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        vocab = state.engine.limits.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(f"Token id {bad} is out of vocabulary", param="prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return _completion_prompt_ids(state, prompt[0])
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError("The simulator serves one prompt per request.", param="prompt")
    raise ApiError("The prompt cannot be empty.", param="prompt")


def _usage(stream: RequestStream, f: FinishedRequest) -> dict[str, Any]:
    n_out = f.num_output_tokens
    return {
        "prompt_tokens": f.num_prompt_tokens,
        "total_tokens": f.num_prompt_tokens + n_out,
        "completion_tokens": n_out,
        "prompt_tokens_details": {"cached_tokens": f.num_cached_tokens},
    }


def _submit(
    state: ServerState, body: CompletionRequest | ChatCompletionRequest, ids: list[int], max_tokens: int
) -> tuple[str, RequestStream]:
    rid = f"{uuid.uuid4().hex}"
    stream = state.loop.submit(
        rid,
        ids,
        max_tokens,
        ignore_eos=body.ignore_eos,
        sample_seed=body.seed,
        greedy=body.temperature == 0,
        stream=body.stream,
    )
    return rid, stream


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body: CompletionRequest = await _parse(request, CompletionRequest)
    _check_model(state, body.model)
    ids = _completion_prompt_ids(state, body.prompt)
    max_tokens = check_lengths(len(ids), body.max_tokens, state.engine.limits.max_model_len)
    return await _generate(request, state, body, ids, max_tokens, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
    _check_model(state, body.model)
    if not body.messages:
        raise ApiError("messages must not be empty", param="messages")
    ids = state.tokenizer.encode(render_chat(body.messages))
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = check_lengths(len(ids), requested, state.engine.limits.max_model_len)
    return await _generate(request, state, body, ids, max_tokens, chat=True)


async def _generate(
    request: web.Request,
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    max_tokens: int,
    *,
    chat: bool,
) -> web.StreamResponse:
    rid, stream = _submit(state, body, ids, max_tokens)
    try:
        if body.stream:
            return await _stream_response(request, state, body, ids, stream, chat=chat)
        return await _full_response(state, body, ids, stream, chat=chat)
    finally:
        if stream.finished is None:
            # Client gone (handler cancelled or write failed): free the request's KV now.
            state.loop.abort(rid)


async def _full_response(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    stream: RequestStream,
    *,
    chat: bool,
) -> web.Response:
    while True:
        item = await stream.queue.get()
        if isinstance(item, FinishedRequest):
            break
    f = item
    text = state.tokenizer.decode(f.output_token_ids)
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": f.finish_reason.value}
    choice["stop_reason"] = None
    if chat:
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
    else:
        choice["text"] = text
    out: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{stream.request_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [choice],
        "usage": _usage(stream, f),
    }
    if body.return_token_ids:
        choice["token_ids"] = list(f.output_token_ids)
        out["prompt_token_ids"] = ids
        if not chat:
            choice["prompt_token_ids"] = ids
    return web.json_response(out)


async def _stream_response(
    request: web.Request,
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    stream: RequestStream,
    *,
    chat: bool,
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    cid = f"{'chatcmpl' if chat else 'cmpl'}-{stream.request_id}"
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    async def send(choices: list[dict[str, Any]], **extra: Any) -> None:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client disconnected")
        chunk = {"id": cid, "object": obj, "created": created, "model": state.model_name, "choices": choices}
        chunk.update(extra)
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    first = True
    if chat:
        await send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}])  # fmt: skip
    with contextlib.suppress(ConnectionResetError):
        while True:
            item = await stream.queue.get()
            if isinstance(item, TokenDelta):
                text = state.tokenizer.decode_delta(item.token_ids, first)
                choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
                if chat:
                    choice["delta"] = {"content": text}
                else:
                    choice["text"] = text
                extra: dict[str, Any] = {}
                if body.return_token_ids:
                    choice["token_ids"] = item.token_ids
                    if first:
                        extra["prompt_token_ids"] = ids
                        if not chat:
                            choice["prompt_token_ids"] = ids
                first = False
                await send([choice], **extra)
                continue
            f = item
            last: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": f.finish_reason.value}
            last["stop_reason"] = None
            if chat:
                last["delta"] = {}
            else:
                last["text"] = ""
            await send([last])
            if include_usage:
                await send([], usage=_usage(stream, f))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            break
    return resp


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
    p = argparse.ArgumentParser(prog="misat sim-engine", description="Simulated vLLM engine server.")
    p.add_argument("--profile", default="qwen30b-a3b-h100", choices=sorted(PROFILES))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--length-scale", type=float, default=None)
    p.add_argument("--engine-index", type=int, default=0)
    p.add_argument("--no-prefix-caching", action="store_true")
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
