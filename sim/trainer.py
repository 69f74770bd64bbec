"""Trainer emulator: releases rollout units against any OpenAI-compatible base URL.

Why: the router must be measured under the load an RL trainer really puts on
it: a target mixture of classes, a ceiling on units in flight (the "static
concurrency" the paper sweeps), agentic sessions that hold their slot through
tool gaps, and iterations separated by a weight update (prefix caches reset,
router paused). This module is the thin async shell; what to send comes from
``misat_sim.workload`` and the arithmetic of the report from
``misat_sim.report``.

Protocol per request: ``POST {base_url}/v1/completions`` with a token-id
prompt, ``max_tokens``, ``ignore_eos: true`` and ``return_token_ids: true``
(optionally streamed), headers ``X-Rollout-Class``, ``X-Session-Id``,
``X-Session-Turn`` (0-based) and ``X-Session-End: 1`` on an agentic session's
last turn. The next agentic prompt is ``prompt + returned output ids + tool
tokens``, so prefix caches can hit. 503 (or 429) answers are retried after
their ``Retry-After``; everything else that fails gives the unit up (counted).

Time: the clock and the sleep are injected. Tool gaps are *simulated tool
time* (``asyncio.sleep(gap / time_scale)``), part of the workload, not a
synchronisation device.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from functools import partial
from typing import Any, Literal

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, model_validator

from misat_sim.report import RunStats, TrainerReport, Usage
from misat_sim.workload import RolloutClass, SessionPlan, Workload, WorkloadSpec

Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]

RETRY_STATUSES: frozenset[int] = frozenset({429, 503})
"""Answers that mean "not now": the router holds work and may time a held request
out with 503 + Retry-After; the request is sent again, never dropped."""


class Hook(BaseModel):
    """One HTTP call of the weight update between iterations."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    method: str = "POST"
    url: str


class TrainerConfig(BaseModel):
    """Knobs of the trainer emulator (all documented in docs/workloads.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    base_url: str = Field(description="router or engine, e.g. http://127.0.0.1:8000")
    model: str = Field(default="misat-sim", description="the request's `model` field")
    max_in_flight: int = Field(default=64, ge=1, description="units in flight ceiling")
    mode: Literal["iterations", "continuous"] = "continuous"
    iterations: int = Field(default=1, ge=1, description="iterations mode: how many")
    batch_units: int = Field(default=128, ge=1, description="iterations mode: units per batch")
    hooks: tuple[Hook, ...] = Field(default=(), description="called after every iteration")
    duration_s: float | None = Field(default=None, gt=0, description="continuous: stop after")
    max_units: int | None = Field(default=None, ge=1, description="continuous: release this many")
    drain: bool = Field(default=False, description="continuous + duration: finish in-flight units")
    time_scale: float = Field(default=1.0, gt=0, description="tool gaps last gap / time_scale")
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0)
    request_timeout_s: float = Field(default=1800.0, gt=0, description="one attempt, incl. holds")
    max_retries: int = Field(default=1000, ge=0, description="503/429 retries per request")
    retry_after_default_s: float = Field(default=1.0, ge=0, description="when none is given")
    bucket_s: float = Field(default=1.0, gt=0, description="throughput time-series bucket")

    @model_validator(mode="after")
    def _stop_condition(self) -> TrainerConfig:
        if self.mode == "continuous" and self.duration_s is None and self.max_units is None:
            raise ValueError("continuous mode needs duration_s or max_units")
        return self


def parse_retry_after(value: str | None, default: float, now: datetime | None = None) -> float:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP date)."""
    if value is None:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return default
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def request_headers(plan: SessionPlan, turn: int) -> dict[str, str]:
    """The session headers the router keys admission on."""
    headers = {
        "X-Rollout-Class": plan.klass.value,
        "X-Session-Id": plan.session_id,
        "X-Session-Turn": str(turn),
    }
    if plan.klass is RolloutClass.AGENTIC and turn == plan.last_turn:
        headers["X-Session-End"] = "1"
    return headers


def parse_usage(usage: dict[str, Any] | None, prompt_len: int, output_len: int) -> Usage:
    """OpenAI ``usage`` -> ``Usage``; counts from the request itself when it is missing."""
    if not usage:
        return Usage(prompt_tokens=prompt_len, completion_tokens=output_len)
    details = usage.get("prompt_tokens_details") or {}
    return Usage(
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
    )


class _GiveUp(Exception):
    """A request failed for good; its unit is abandoned (already counted)."""


class Trainer:
    """Runs a workload against ``config.base_url``; ``run()`` returns the report."""

    def __init__(
        self,
        config: TrainerConfig,
        spec: WorkloadSpec,
        *,
        session: aiohttp.ClientSession | None = None,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.config = config
        self.workload = Workload(spec)
        self._session = session
        self._clock = clock
        self._sleep = sleep
        self._url = config.base_url.rstrip("/") + "/v1/completions"
        self.stats = RunStats(start=clock(), bucket_s=config.bucket_s)

    def snapshot(self) -> TrainerReport:
        """Live figures for a progress display (safe to call while running)."""
        return self.stats.report(self._clock())

    async def run(self) -> TrainerReport:
        """Run to the configured stop condition and report."""
        own = self._session is None
        session = self._session or aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
        )
        self._session = session
        self.stats = RunStats(start=self._clock(), bucket_s=self.config.bucket_s)
        try:
            if self.config.mode == "iterations":
                await self._run_iterations()
            else:
                await self._run_continuous()
        finally:
            if own:
                await session.close()
                self._session = None
        return self.snapshot()

    # --- release loops ------------------------------------------------------------------

    def _position(self) -> float | None:
        """Phase position for the workload (None: units released so far)."""
        if self.workload.spec.phase_axis == "seconds":
            return self._clock() - self.stats.start
        return None

    def _draw(self, pending: deque[tuple[SessionPlan, dict[RolloutClass, float]]]) -> None:
        """Queue the next release with the target mixture it was drawn under."""
        at = self._position()
        position = float(self.workload.units_released) if at is None else at
        target = self.workload.spec.mixture_at(position)
        pending.extend((plan, target) for plan in self.workload.draw(at))

    async def _pump(
        self,
        pending: deque[tuple[SessionPlan, dict[RolloutClass, float]]],
        may_release: Callable[[], bool],
        deadline: float | None,
    ) -> None:
        """Keep at most ``max_in_flight`` units running while units may be released.

        ``may_release()`` says whether the head of ``pending`` may start now,
        refilling ``pending`` first if it must. At ``deadline`` unfinished units
        are cancelled (they do not count as completed).
        """
        tasks: set[asyncio.Task[None]] = set()
        while True:
            while len(tasks) < self.config.max_in_flight and may_release():
                plan, target = pending.popleft()
                self.stats.on_released(target)
                tasks.add(asyncio.create_task(self._run_unit(plan)))
            if not tasks:
                return
            timeout = None if deadline is None else max(0.0, deadline - self._clock())
            _, tasks = await asyncio.wait(
                tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if deadline is not None and self._clock() >= deadline:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return

    async def _run_continuous(self) -> None:
        cfg = self.config
        pending: deque[tuple[SessionPlan, dict[RolloutClass, float]]] = deque()
        start = self.stats.start
        deadline = start + cfg.duration_s if cfg.duration_s is not None else None

        def may_release() -> bool:
            if cfg.max_units is not None and self.stats.released >= cfg.max_units:
                return False
            if deadline is not None and self._clock() >= deadline:
                return False
            if not pending:
                self._draw(pending)
            return True

        await self._pump(pending, may_release, None if cfg.drain else deadline)

    async def _run_iterations(self) -> None:
        cfg = self.config
        for _ in range(cfg.iterations):
            began = self._clock()
            batch: deque[tuple[SessionPlan, dict[RolloutClass, float]]] = deque()
            while len(batch) < cfg.batch_units:
                self._draw(batch)
            await self._pump(batch, partial(bool, batch), None)
            await self._call_hooks()
            self.stats.on_iteration(self._clock() - began)

    async def _call_hooks(self) -> None:
        """The weight update: each hook in order, each awaited before the next."""
        assert self._session is not None
        for hook in self.config.hooks:
            try:
                async with self._session.request(hook.method, hook.url) as resp:
                    await resp.read()
                    if resp.status >= 400:
                        self.stats.on_error(f"hook_http_{resp.status}", f"{hook.method} {hook.url}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.stats.on_error("hook_unreachable", f"{hook.method} {hook.url}: {exc}")

    # --- one unit -----------------------------------------------------------------------

    async def _run_unit(self, plan: SessionPlan) -> None:
        """All turns of one unit; tool gaps in between are simulated tool time."""
        ok = False
        try:
            prompt = plan.initial_prompt()
            output: list[int] = []
            for t, turn in enumerate(plan.turns):
                if t > 0:
                    prompt = plan.next_prompt(prompt, output, t)
                output = await self._complete(plan, t, prompt, turn.max_tokens)
                if t < plan.last_turn and turn.tool_gap_s > 0:
                    await self._sleep(turn.tool_gap_s / self.config.time_scale)
            ok = True
        except _GiveUp:
            pass
        finally:
            self.stats.on_unit_done(plan.klass, self._clock(), ok)

    def _body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.config.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "return_token_ids": True,
            "temperature": self.config.temperature,
        }
        if self.config.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    async def _complete(
        self, plan: SessionPlan, turn: int, prompt: list[int], max_tokens: int
    ) -> list[int]:
        """One request with retries; returns the output token ids."""
        assert self._session is not None
        body, headers = self._body(prompt, max_tokens), request_headers(plan, turn)
        for attempt in range(self.config.max_retries + 1):
            delay: float | None = None
            try:
                async with self._session.post(self._url, json=body, headers=headers) as resp:
                    if resp.status in RETRY_STATUSES and attempt < self.config.max_retries:
                        await resp.read()
                        delay = parse_retry_after(
                            resp.headers.get("Retry-After"), self.config.retry_after_default_s
                        )
                    elif resp.status != 200:
                        detail = await resp.text(errors="replace")
                        self.stats.on_error(f"http_{resp.status}", detail)
                        raise _GiveUp
                    elif self.config.stream:
                        ids, usage = await _read_stream(resp)
                    else:
                        ids, usage = _read_json(await resp.json())
            except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
                self.stats.on_error(type(exc).__name__, str(exc))
                raise _GiveUp from exc
            if delay is not None:
                self.stats.on_retry()
                await self._sleep(delay)
                continue
            result = parse_usage(usage, len(prompt), len(ids or []))
            self.stats.on_request(plan.klass, result)
            if ids is None:
                self.stats.on_missing_token_ids()
                ids = plan.synthetic_output(turn, result.completion_tokens or max_tokens)
            return ids
        raise AssertionError("unreachable: the last attempt never retries")


def _read_json(data: dict[str, Any]) -> tuple[list[int] | None, dict[str, Any] | None]:
    """Output ids and usage of a non-streamed completion."""
    choices = data.get("choices") or [{}]
    ids = choices[0].get("token_ids")
    return (list(ids) if ids is not None else None), data.get("usage")


async def _read_stream(
    resp: aiohttp.ClientResponse,
) -> tuple[list[int] | None, dict[str, Any] | None]:
    """Output ids (concatenated deltas) and usage (last chunk) of a streamed completion."""
    ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        for choice in chunk.get("choices") or []:
            delta = choice.get("token_ids")
            if delta is not None:
                ids = [] if ids is None else ids
                ids.extend(delta)
        if chunk.get("usage"):
            usage = chunk["usage"]
    return ids, usage
