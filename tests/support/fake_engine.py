"""A small, configurable fake vLLM engine for the router, reliability and fuzz tests.

``FakeEngine`` speaks the part of vLLM's HTTP surface the router uses
(``docs/real-vllm.md``): ``/v1/completions`` and ``/v1/chat/completions`` (JSON and SSE,
with ``usage`` and ``prompt_tokens_details.cached_tokens``), ``/v1/models``, ``/tokenize``,
``/health``, ``/metrics`` with vLLM's names, ``/reset_prefix_cache``.

Answers are deterministic (``max_tokens`` tokens ``t0 t1 ...``, ids ``0 1 ...`` with
``return_token_ids``, usage counted from the prompt), so a routed answer can be compared byte for byte with a direct one. Any body is
answered without a crash: invalid JSON is a 400 in vLLM's error shape, odd fields fall back
to defaults (the fuzz suite sends everything).

Hooks (attributes a test sets while the engine runs):

- ``healthy``: ``/health`` answers 503 when False;
- ``gate``: hold generation answers until the event is set; ``stall_generation``: hold them
  forever (the router's timeout must end them);
- ``mid_stream_gate``: pause a stream after its first chunk until set; ``stall_after_first_chunk``:
  pause it forever; ``break_stream_after``: drop the connection after that many chunks;
- ``fail_status``: answer generation requests with that status and a vLLM error body;
  ``fail_marker``: the same with 500 for bodies containing those bytes;
- ``cached_tokens``: reported per answer (and counted as prefix-cache hits in ``/metrics``);
- ``metrics_mode``: ``/metrics`` is the real page (``"ok"``), never answers (``"slow"``), or
  one of the broken bodies of ``METRICS_MODES``;
- ``stall_models``, ``stall_reset``: ``/v1/models``, ``/reset_prefix_cache`` never answer;
- ``die()``: stop listening (connection refused).

Counters: ``generations`` (every generation request that arrived), ``requests`` and
``headers`` (those with a JSON body), ``cancelled`` (aborted by their client mid-answer),
``in_flight``, ``metrics_hits``, ``metrics_stuck``, ``prefix_resets``, ``prefix_queries``, ``prefix_hits``;
``wait_arrivals``, ``wait_cancelled`` and ``wait_metrics_hits`` wait on them, bounded.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from .router_config import MODEL

BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 64
DEFAULT_MAX_TOKENS = 3
"""Tokens of an answer when the request gives no usable ``max_tokens``."""
MAX_ANSWER_TOKENS = 1024
"""Largest answer (a request asking for more gets this many)."""
WAIT_S = 10.0
"""Default bound of the engine's waits; a healthy run takes milliseconds."""

METRICS_MODES: dict[str, str | None] = {
    "ok": None,
    "empty": "",
    "garbage": "<html><body>502 Bad Gateway</body></html>",
    "not-vllm": "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n",
    "overflow": 'vllm:num_requests_running{engine="0"} 1e999\n',
    "nan": 'vllm:kv_cache_usage_perc{engine="0"} NaN\n',
    "negative": 'vllm:num_requests_waiting{engine="0"} -5\n',
    "binary": "\x00\x01\x02\udcff",
}
"""``/metrics`` bodies by mode; ``ok`` is the real page, ``slow`` never answers."""


def _error(status: int, message: str) -> web.Response:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return web.json_response({"object": "error", "message": message, "type": kind, "param": None,
                              "code": status}, status=status)


def _words(value: object) -> int:
    return len(str(value).split())


def _prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(_words(m.get("content", "") if isinstance(m, dict) else m) for m in messages)
    prompt = body.get("prompt", "")
    return len(prompt) if isinstance(prompt, list) else _words(prompt)


class FakeEngine:
    """A vLLM look-alike on a loopback port (``start()``), with the hooks above."""

    def __init__(
        self,
        name: str,
        *,
        model: str = MODEL,
        block_size: int = BLOCK_SIZE,
        num_gpu_blocks: int = NUM_GPU_BLOCKS,
        running: int | None = None,
        kv_usage: float | None = None,
        max_answer_tokens: int = MAX_ANSWER_TOKENS,
        client_max_size: int = 1024**2,
        wait_s: float = WAIT_S,
    ) -> None:
        """``running`` and ``kv_usage`` fix what ``/metrics`` reports (None: the requests in
        flight, and that count over 8); ``wait_s`` bounds the ``wait_*`` helpers."""
        self.name = name
        self.model = model
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.running = running
        self.kv_usage = kv_usage
        self.max_answer_tokens = max_answer_tokens
        self.client_max_size = client_max_size
        self.wait_s = wait_s
        # hooks
        self.healthy = True
        self.gate: asyncio.Event | None = None
        self.mid_stream_gate: asyncio.Event | None = None
        self.break_stream_after: int | None = None
        self.fail_status: int | None = None
        self.fail_marker: bytes | None = None
        self.cached_tokens = 0
        self.metrics_mode = "ok"
        self.stall_generation = False
        self.stall_after_first_chunk = False
        self.stall_models = False
        self.stall_reset = False
        # counters
        self.generations = 0
        self.requests: list[Any] = []
        self.headers: list[dict[str, str]] = []
        self.cancelled = 0
        self.in_flight = 0
        self.metrics_hits = 0
        self.metrics_stuck = 0
        """``/metrics`` requests held by the ``slow`` mode right now."""
        self.prefix_resets = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._arrived = asyncio.Event()
        self._cancelled_event = asyncio.Event()
        self._hit = asyncio.Event()
        self._never = asyncio.Event()
        self._server: TestServer | None = None
        self.url = ""

    # ---- waits for tests ----------------------------------------------------------------

    async def wait_arrivals(self, n: int) -> None:
        """Wait until ``n`` generation requests with a JSON body have arrived (bounded)."""
        async with asyncio.timeout(self.wait_s):
            while len(self.requests) < n:
                self._arrived.clear()
                await self._arrived.wait()

    async def wait_cancelled(self, n: int) -> None:
        """Wait until ``n`` requests were aborted by their client (the router) mid-answer."""
        async with asyncio.timeout(self.wait_s):
            while self.cancelled < n:
                self._cancelled_event.clear()
                await self._cancelled_event.wait()

    async def wait_metrics_hits(self, n: int) -> None:
        """Wait until ``/metrics`` has been asked ``n`` times (bounded)."""
        async with asyncio.timeout(self.wait_s):
            while self.metrics_hits < n:
                self._hit.clear()
                await self._hit.wait()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(client_max_size=self.client_max_size)
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

    async def die(self) -> None:
        """Stop listening: the router now gets connection refused."""
        assert self._server is not None
        await self._server.close()

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()

    # ---- the page ------------------------------------------------------------------------

    def metrics_text(self) -> str:
        """The ``/metrics`` page in ``"ok"`` mode, with vLLM's metric names."""
        labels = f'engine="0",model_name="{self.model}"'
        running = self.in_flight if self.running is None else self.running
        kv = min(1.0, running / 8) if self.kv_usage is None else self.kv_usage
        return "\n".join([
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {running}.0",
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
            f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",engine="0",'
            f'num_gpu_blocks="{self.num_gpu_blocks}",num_gpu_blocks_override="None",'
            f'enable_prefix_caching="True"}} 1.0',
            "",
        ])

    # ---- handlers ------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_hits += 1
        self._hit.set()
        if self.metrics_mode == "slow":
            self.metrics_stuck += 1
            try:
                await self._never.wait()
            finally:
                self.metrics_stuck -= 1
        body = METRICS_MODES[self.metrics_mode]
        if body is None:
            body = self.metrics_text()
        return web.Response(body=body.encode("utf-8", "surrogateescape"), content_type="text/plain")

    async def _reset(self, request: web.Request) -> web.Response:
        if self.stall_reset:
            await self._never.wait()
        self.prefix_resets += 1
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        if self.stall_models:
            await self._never.wait()
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                         "owned_by": self.name}]}
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except (ValueError, RecursionError):
            return _error(400, "bad json")
        prompt = body.get("prompt", "") if isinstance(body, dict) else ""
        n = _words(prompt)
        return web.json_response({"count": n, "max_model_len": 2048, "tokens": list(range(n))})

    def _answer_tokens(self, body: dict[str, Any]) -> int:
        n = body.get("max_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return DEFAULT_MAX_TOKENS
        return min(n, self.max_answer_tokens)

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        self.generations += 1
        if self.fail_marker is not None and self.fail_marker in raw:
            return _error(500, "engine says no")
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            return _error(400, "bad json")
        self.requests.append(parsed)
        self.headers.append(dict(request.headers))
        self._arrived.set()
        body: dict[str, Any] = parsed if isinstance(parsed, dict) else {}
        self.in_flight += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.stall_generation:
                await self._never.wait()
            if self.fail_status is not None:
                return _error(self.fail_status, "engine says no")
            prompt_tokens = _prompt_tokens(body, chat)
            n = self._answer_tokens(body)
            self.prefix_queries += prompt_tokens
            self.prefix_hits += min(self.cached_tokens, prompt_tokens)
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n,
                "total_tokens": prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            }
            if body.get("stream") is True:
                return await self._stream(request, body, chat, n, usage)
            text = " ".join(f"t{i}" for i in range(n))
            if chat:
                out = {
                    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": self.model,
                    "choices": [{"index": 0, "finish_reason": "length",
                                 "message": {"role": "assistant", "content": text}}],
                    "usage": usage,
                }
            else:
                choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
                if body.get("return_token_ids") is True:
                    choice["token_ids"] = list(range(n))  # vLLM's return_token_ids: token t<i> is id i
                out = {
                    "id": "cmpl-1", "object": "text_completion", "created": 1, "model": self.model,
                    "choices": [choice], "usage": usage,
                }
            return web.json_response(out, headers={"X-Engine-Name": self.name})
        except asyncio.CancelledError:
            self.cancelled += 1
            self._cancelled_event.set()
            raise
        finally:
            self.in_flight -= 1

    async def _stream(
        self, request: web.Request, body: dict[str, Any], chat: bool, n: int, usage: dict[str, Any]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Engine-Name": self.name})
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
            chunk = {"id": "cmpl-1", "object": kind, "created": 1, "model": self.model, "choices": [choice]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if i == 0:
                if self.mid_stream_gate is not None:
                    await self.mid_stream_gate.wait()
                if self.stall_after_first_chunk:
                    await self._never.wait()
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            chunk = {"id": "cmpl-1", "object": kind, "created": 1, "model": self.model, "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=True)
