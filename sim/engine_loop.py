"""Runs a ``SimEngine`` in scaled real time for the HTTP server.

Modelled time is wall time since start times ``time_scale``. A background
task steps the engine while it has work: it computes a step, sleeps the
step's modelled duration divided by ``time_scale``, then delivers what the
step produced (tokens are emitted when the step ends, as on a GPU). With no
work it waits on an ``asyncio.Event`` that ``submit`` sets: no polling.

Each request gets a ``RequestStream``: an ``asyncio.Queue`` of token deltas
and a final ``FinishedRequest``. Handlers read it for streaming and
non-streaming answers alike, and call ``abort`` when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from misat_sim.engine import FinishedRequest, SimEngine
from misat_sim.metrics import EngineMetrics


@dataclass(slots=True)
class TokenDelta:
    """Token ids a request emitted in one step."""

    token_ids: list[int]


class RequestStream:
    """Events of one request: ``TokenDelta`` items, then a ``FinishedRequest``."""

    def __init__(self, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.queue: asyncio.Queue[TokenDelta | FinishedRequest] = asyncio.Queue()
        self.sent = 0
        self.num_cached_tokens = 0
        self.finished: FinishedRequest | None = None


class EngineLoop:
    """Owns the engine, its metrics, and the task that steps it."""

    def __init__(self, engine: SimEngine, metrics: EngineMetrics, time_scale: float) -> None:
        self.engine = engine
        self.metrics = metrics
        self.time_scale = time_scale
        self.streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0

    def now(self) -> float:
        """Modelled time now."""
        return (asyncio.get_running_loop().time() - self._t0) * self.time_scale

    async def start(self) -> None:
        """Start the stepping task."""
        self._t0 = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._run(), name="sim-engine-loop")

    async def stop(self) -> None:
        """Stop the stepping task."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def server_load(self) -> int:
        """Requests in flight (vLLM's ``/load``)."""
        return len(self.streams)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        ignore_eos: bool,
        sample_seed: int | None,
        greedy: bool,
    ) -> RequestStream:
        """Queue a request in the engine and return its stream."""
        stream = RequestStream(request_id, len(prompt_token_ids))
        self.engine.add_request(
            request_id,
            prompt_token_ids,
            max_tokens,
            ignore_eos=ignore_eos,
            arrival_time=self.now(),
            sample_seed=sample_seed,
            greedy=greedy,
        )
        self.streams[request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request (client gone): frees its blocks now."""
        if self.streams.pop(request_id, None) is not None:
            self.engine.abort_request(request_id, self.now())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            result = engine.step(self.now())
            wake_at = self._t0 + result.end / self.time_scale
            delay = wake_at - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            self._deliver(result.new_tokens, result.finished)

    def _deliver(self, new_tokens: dict[str, int], finished: list[FinishedRequest]) -> None:
        streams = self.streams
        done = {f.request_id for f in finished}
        for rid in new_tokens:
            stream = streams.get(rid)
            if stream is None or rid in done:
                continue
            req = self.engine.get_request(rid)
            if req is None:
                continue
            if stream.sent == 0:
                stream.num_cached_tokens = max(req.num_cached_tokens, 0)
            ids = req.materialize_outputs()
            stream.queue.put_nowait(TokenDelta(ids[stream.sent :]))
            stream.sent = len(ids)
        for f in finished:
            self.metrics.observe_finished(f)
            stream = streams.pop(f.request_id, None)
            if stream is None:
                continue
            if len(f.output_token_ids) > stream.sent:
                stream.queue.put_nowait(TokenDelta(f.output_token_ids[stream.sent :]))
                stream.sent = len(f.output_token_ids)
            stream.finished = f
            stream.queue.put_nowait(f)
