"""A small fake vLLM engine and a router harness for the router tests.

``FakeEngine`` speaks the part of vLLM's HTTP surface the router uses
(``docs/real-vllm.md``): ``/v1/completions`` and ``/v1/chat/completions``
(JSON and SSE, with ``usage`` and ``prompt_tokens_details.cached_tokens``),
``/v1/models``, ``/tokenize``, ``/health``, ``/metrics`` with vLLM's names,
``/reset_prefix_cache``. Hooks: ``gate`` (hold answers until released),
``mid_stream_gate`` (pause a stream after its first chunk), ``healthy``
(``/health`` answers 503 when False), ``fail_status`` (answer
generation requests with that status and a vLLM error body), ``break_stream_after``
(drop the connection mid-stream), ``die()`` (stop listening: connection
refused). Answers are deterministic, so a routed answer can be compared byte
for byte with a direct one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from misat_router.app import STATE, RouterState, create_app
from misat_router.config import RouterConfig

MODEL = "tiny"
BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 64
DEFAULT_MAX_TOKENS = 3
WAIT_S = 5.0
"""Bound of every wait in these tests; a healthy run takes milliseconds."""


class FakeEngine:
    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.healthy = True
        self.gate: asyncio.Event | None = None
        self.break_stream_after: int | None = None
        self.mid_stream_gate: asyncio.Event | None = None
        self.cancelled = 0
        self._cancelled_event = asyncio.Event()
        self.cached_tokens = 0
        self.fail_status: int | None = None
        self.prefix_resets = 0
        self.running = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._arrived = asyncio.Event()
        self._server: TestServer | None = None
        self.url = ""

    # ---- hooks for tests --------------------------------------------------

    async def wait_arrivals(self, n: int) -> None:
        """Wait until ``n`` generation requests have arrived (bounded)."""
        async with asyncio.timeout(WAIT_S):
            while len(self.requests) < n:
                self._arrived.clear()
                await self._arrived.wait()

    async def wait_cancelled(self, n: int) -> None:
        """Wait until ``n`` requests were aborted by their client (the router) mid-answer."""
        async with asyncio.timeout(WAIT_S):
            while self.cancelled < n:
                self._cancelled_event.clear()
                await self._cancelled_event.wait()

    async def die(self) -> None:
        assert self._server is not None
        await self._server.close()

    # ---- server -------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/reset_prefix_cache", self._reset)
        self._server = TestServer(app, host="127.0.0.1")
        await self._server.start_server()
        self.url = str(self._server.make_url("")).rstrip("/")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _reset(self, request: web.Request) -> web.Response:
        self.prefix_resets += 1
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                         "owned_by": self.name}]}
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        words = str(body.get("prompt", "")).split()
        return web.json_response({"count": len(words), "max_model_len": 2048,
                                  "tokens": list(range(len(words)))})

    def _metrics_text(self) -> str:
        labels = f'engine="0",model_name="{MODEL}"'
        kv = min(1.0, self.running / 8)
        return "\n".join([
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {self.running}.0",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} 0.0",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {kv}",
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{labels}}} {float(self.prefix_queries)}",
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} {float(self.prefix_hits)}",
            "# HELP vllm:num_preemptions_total Cumulative number of preemptions.",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{labels}}} 0.0",
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",cache_dtype="auto",engine="0",'
            f'num_gpu_blocks="{NUM_GPU_BLOCKS}",num_gpu_blocks_override="None",'
            f'enable_prefix_caching="True"}} 1.0',
            "",
        ])

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self._metrics_text(), content_type="text/plain")

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        self._arrived.set()
        self.running += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.fail_status is not None:
                err = {"object": "error", "message": "engine says no", "type": "BadRequestError",
                       "param": None, "code": self.fail_status}
                return web.json_response(err, status=self.fail_status)
            if chat:
                prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
            else:
                p = body["prompt"]
                prompt_tokens = len(p) if isinstance(p, list) else len(str(p).split())
            n = body.get("max_tokens") or DEFAULT_MAX_TOKENS
            self.prefix_queries += prompt_tokens
            self.prefix_hits += min(self.cached_tokens, prompt_tokens)
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n,
                "total_tokens": prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            }
            if body.get("stream"):
                return await self._stream(request, body, chat, n, usage)
            if chat:
                out = {
                    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
                    "choices": [{"index": 0, "finish_reason": "length",
                                 "message": {"role": "assistant",
                                             "content": " ".join(f"t{i}" for i in range(n))}}],
                    "usage": usage,
                }
            else:
                out = {
                    "id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
                    "choices": [{"index": 0, "text": " ".join(f"t{i}" for i in range(n)),
                                 "finish_reason": "length", "logprobs": None}],
                    "usage": usage,
                }
            return web.json_response(out, headers={"X-Engine-Name": self.name})
        except asyncio.CancelledError:
            self.cancelled += 1
            self._cancelled_event.set()
            raise
        finally:
            self.running -= 1

    async def _stream(
        self, request: web.Request, body: dict[str, Any], chat: bool, n: int, usage: dict[str, Any]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "X-Engine-Name": self.name})
        await resp.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        for i in range(n):
            if self.break_stream_after is not None and i >= self.break_stream_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            last = i == n - 1
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
            if chat:
                choice["delta"] = {"content": f"t{i} "}
            else:
                choice["text"] = f"t{i} "
                choice["logprobs"] = None
            chunk = {"id": "cmpl-1", "object": kind, "created": 1, "model": MODEL,
                     "choices": [choice]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if i == 0 and self.mid_stream_gate is not None:
                await self.mid_stream_gate.wait()
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = {"id": "cmpl-1", "object": kind, "created": 1, "model": MODEL,
                     "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=True)


async def open_parked_stream(
    http: aiohttp.ClientSession, router_url: str, **body: Any
) -> tuple[aiohttp.ClientResponse, bytes]:
    """POST a streamed 3-token rlvr completion and read its first event. With the engine's
    ``mid_stream_gate`` set to an unset ``asyncio.Event``, the stream then stays open (in flight
    at the router) until the test sets the gate. Returns the response and that first event."""
    resp = await http.post(router_url + "/v1/completions",
                           json={"model": MODEL, "prompt": [1], "max_tokens": 3, "stream": True, **body},
                           headers={"X-Rollout-Class": "rlvr"})
    return resp, await resp.content.readuntil(b"\n\n")


def router_config(urls: list[str], **overrides: Any) -> RouterConfig:
    """A config with fast probe and epoch intervals, so tests react in milliseconds."""
    policy = overrides.pop("policy", {})
    base: dict[str, Any] = {
        "generation": 1,
        "model": MODEL,
        "engines": {"urls": urls},
        "workloads": {
            "classes": [
                {"name": "rlvr", "share": 40},
                {"name": "rlhf", "share": 20},
                {"name": "agentic", "share": 40, "multi_turn": True},
            ],
            "default_class": None,
        },
        "policy": {"name": "round-robin", "admission": {"epoch_s": 0.05}, **policy},
        "scrape_interval_s": 0.05,
        "health_interval_s": 0.05,
        "health_timeout_s": 1.0,
        "unhealthy_after_failures": 1,
        "upstream_connect_timeout_s": 1.0,
        "hold_deadline_s": 5.0,
        "config_poll_interval_s": 0.05,
        "drain_timeout_s": 1.0,
    }
    base.update(overrides)
    return RouterConfig.model_validate(base)


class RouterHarness:
    """A running router app in front of fake engines."""

    def __init__(self, server: TestServer, engines: list[FakeEngine]) -> None:
        self.server = server
        self.engines = engines

    @property
    def state(self) -> RouterState:
        return self.server.app[STATE]  # type: ignore[index]

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def wait(self, predicate: Callable[[], bool]) -> None:
        await self.state.wait_until(predicate, WAIT_S)

    async def wait_healthy(self, n: int) -> None:
        await self.wait(lambda: self.state.registry.healthy_count() == n)


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    fakes = [FakeEngine("a"), FakeEngine("b")]
    for f in fakes:
        await f.start()
    yield fakes
    for f in fakes:
        if f._server is not None:
            await f._server.close()


async def start_router(
    fakes: list[FakeEngine], /, *, admin_token: str | None = None, config_path: str | None = None,
    **overrides: Any,
) -> RouterHarness:
    """A router in front of ``fakes``; keyword overrides replace RouterConfig fields."""
    cfg = router_config([e.url for e in fakes], **overrides)
    app = create_app(cfg, admin_token=admin_token, config_path=config_path)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    h = RouterHarness(server, fakes)
    if fakes:
        await h.wait_healthy(len(fakes))
    return h


@pytest.fixture
async def make_router() -> AsyncIterator[Callable[..., Any]]:
    started: list[RouterHarness] = []

    async def make(fakes: list[FakeEngine], /, **kw: Any) -> RouterHarness:
        h = await start_router(fakes, **kw)
        started.append(h)
        return h

    yield make
    for h in started:
        await h.server.close()
