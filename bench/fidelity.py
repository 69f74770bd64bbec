"""Trace-replay fidelity harness: the same seeded trace against any OpenAI-compatible server.

Why: the simulator (``misat_sim.server``) is only useful if it shows the
same dynamics as a real vLLM engine under the same load: how much of the
prompt is served from the prefix cache, when the KV cache forces preemption,
how long the waiting queue grows, in which order requests finish. This
module replays one deterministic trace against a base URL (the real vLLM CPU
server or the simulator), polls ``/metrics`` while it runs, and reports those
figures as a :class:`FidelityResult`, so two runs can be compared side by
side (``docs/fidelity.md``).

A trace is data (:class:`Trace`): each request has an earliest send offset, a
token-id prompt, ``max_tokens`` and ``ignore_eos``, and may wait for an earlier
request of its session to finish (``after`` plus ``gap_s``), as an agentic
turn waits for the previous one and its tool call. Prompts share prefixes on
purpose: session turns extend the previous turn's prompt, GRPO-style groups
repeat one prompt. Builders are pure and seeded.

Three traces are provided, all for a server with 16 KV blocks of 128 tokens,
``--max-model-len 1024`` and ``--max-num-seqs 8``:

* ``fits``: two GRPO groups and two multi-turn sessions whose working set
  fits the KV cache: prefix hits, no preemption, little queueing.
* ``oversubscribed``: 16 requests of 100 prompt + 400 generated tokens arrive
  together; their KV demand (16 x 4 blocks) is four times the cache, so vLLM
  preempts and the waiting queue grows (docs/real-vllm.md, "Making KV
  pressure visible").
* ``thrash``: the ``fits`` shapes, more of them, interleaved, with long
  outputs: shared prefixes are evicted before they are reused, so the hit
  rate falls well below ``fits`` while preemptions and queueing appear.

``--calibrate`` instead measures the step-time constants of the tiny model
(fixed overhead per step, time per prefill token, time per decoding sequence)
that the simulator's ``tiny-cpu`` profile uses.

CLI: ``python -P -m misat_bench.fidelity --base-url URL --trace NAME --json OUT``;
``--calibrate`` (step-time constants), ``--compare REAL.json SIM.json`` (goals).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field

from misat_router import vllm_metrics as vm

FIRST_TOKEN_ID: int = 3
"""Prompt ids start here: 0..2 are the tiny model's special tokens."""
VOCAB_SIZE: int = 2048
"""Prompt ids stay below this (the tiny model's vocabulary)."""
DEFAULT_POLL_INTERVAL_S: float = 0.25
"""How often ``/metrics`` is scraped during a run; fast enough to see the
waiting queue move on the tiny model (docs/real-vllm.md)."""
REQUEST_TIMEOUT_S: float = 300.0
"""Bound on one completion request; a stuck server fails the run, never hangs it."""
SETTLE_TIMEOUT_S: float = 10.0
"""Bound on waiting for the server's counters to account every finished request."""

# Sample names read off both servers, from the vLLM metrics contract (misat_router.vllm_metrics).
M_WAITING = vm.NUM_REQUESTS_WAITING.sample
M_RUNNING = vm.NUM_REQUESTS_RUNNING.sample
M_KV_USAGE = vm.KV_CACHE_USAGE.sample
M_PREEMPTIONS = vm.NUM_PREEMPTIONS.sample
M_PREFIX_QUERIES = vm.PREFIX_CACHE_QUERIES.sample
M_PREFIX_HITS = vm.PREFIX_CACHE_HITS.sample
M_SUCCESS = vm.REQUEST_SUCCESS.sample
M_PROMPT_TOKENS = vm.PROMPT_TOKENS.sample
M_GENERATION_TOKENS = vm.GENERATION_TOKENS.sample
COUNTERS: tuple[str, ...] = (
    M_PREEMPTIONS, M_PREFIX_QUERIES, M_PREFIX_HITS, M_SUCCESS, M_PROMPT_TOKENS,
    M_GENERATION_TOKENS,
)  # fmt: skip
HISTOGRAMS: tuple[str, ...] = tuple(m.name for m in (
    vm.TIME_TO_FIRST_TOKEN, vm.E2E_REQUEST_LATENCY, vm.REQUEST_QUEUE_TIME,
    vm.REQUEST_PREFILL_TIME, vm.REQUEST_DECODE_TIME, vm.INTER_TOKEN_LATENCY,
))
"""Latency histograms whose mean over the run is reported (when exposed)."""


# ----------------------------------------------------------------------------- data


class TraceRequest(BaseModel):
    """One request of a trace. Sent at ``max(arrival_s, finish(after) + gap_s)``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    kind: str = Field(description="label only: grpo, session, single")
    arrival_s: float = Field(ge=0.0, description="earliest send time, seconds from start")
    prompt: list[int] = Field(min_length=1, description="token ids")
    max_tokens: int = Field(ge=1)
    ignore_eos: bool = True
    after: str | None = Field(default=None, description="id that must finish first")
    gap_s: float = Field(default=0.0, ge=0.0, description="pause after `after` finishes")


class Trace(BaseModel):
    """A named, seeded list of requests plus the server shape it was designed for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str
    seed: int
    server: dict[str, int] = Field(description="num_gpu_blocks, max_model_len, max_num_seqs")
    requests: list[TraceRequest]


class RequestRecord(BaseModel):
    """What the client saw for one request (times are seconds from the run's start)."""

    id: str
    sent_s: float
    finished_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


class FidelityResult(BaseModel):
    """Figures of one trace replay; the unit of comparison between real and simulated.

    Peaks come from polling ``/metrics`` and are lower bounds: vLLM's API server
    can answer a scrape late while it is busy (seen: gaps of 1-4 s on a loaded
    2-core machine), see ``max_scrape_gap_s``. Counter figures are exact
    deltas over the run; ``hit_rate`` is
    ``prefix_cache_hits / prefix_cache_queries`` in tokens, as vLLM 0.32 counts
    them: only a request's first scheduling counts; a preempted request that is
    rescheduled is left out of both counters (``PrefixCacheStats.record``).
    ``client_hit_rate`` is the same ratio from the responses' ``cached_tokens``.
    """

    trace: str
    base_url: str
    cache_reset: bool = Field(description="prefix cache emptied before the run")
    wall_time_s: float
    requests: int
    errors: int
    hit_rate: float | None
    client_hit_rate: float | None
    prefix_cache_queries: float
    prefix_cache_hits: float
    preemptions: float
    peak_waiting: float
    peak_running: float
    peak_kv_usage: float
    scrapes: int
    max_scrape_gap_s: float = Field(
        description="longest time between two answered /metrics polls during the run; "
        "the peaks are only as fine as this (a busy vLLM API server answers late)"
    )
    completion_order: list[str]
    counters: dict[str, float]
    latency_means_s: dict[str, float]
    records: list[RequestRecord]


# ----------------------------------------------------------------------------- traces


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, VOCAB_SIZE) for _ in range(n)]


def fits_trace(seed: int = 7) -> Trace:
    """GRPO groups and multi-turn sessions whose working set fits 16 blocks.

    * 2 GRPO groups x 4 samples of one 260-token prompt (two full 128-token
      blocks shared), 100 tokens each; group 2 arrives 1.5 s after group 1.
    * 2 sessions x 3 turns; turn k+1's prompt is turn k's prompt, 20 tokens
      standing in for its answer, and 110 new tokens (140 -> 270 -> 400),
      sent 0.1 s after turn k finishes; 64 tokens each.

    Samples of a group are 10 ms apart so the arrival order is defined. If
    everything overlapped, the KV demand would be 6 blocks per group (2 shared
    + 4 x 1) and 4 per session turn, 14 of the 16 blocks.
    Expected with vLLM's full-block prefix cache: samples 2-4 of a group hit
    256 tokens, turn 2 hits 128 and turn 3 hits 256, about 62% overall.
    """
    rng = random.Random(seed)
    reqs: list[TraceRequest] = []
    for g, start in enumerate((0.0, 1.5)):
        prompt = _ids(rng, 260)
        reqs.extend(
            TraceRequest(
                id=f"g{g}s{s}",
                kind="grpo",
                arrival_s=start + 0.01 * s,
                prompt=prompt,
                max_tokens=100,
            )
            for s in range(4)
        )
    for sess, start in enumerate((0.3, 0.8)):
        prompt = _ids(rng, 140)
        prev: str | None = None
        for turn in range(3):
            if turn:
                prompt = prompt + _ids(rng, 130)
            rid = f"a{sess}t{turn}"
            reqs.append(
                TraceRequest(
                    id=rid,
                    kind="session",
                    arrival_s=start,
                    prompt=list(prompt),
                    max_tokens=64,
                    after=prev,
                    gap_s=0.1 if prev else 0.0,
                )
            )
            prev = rid
    return Trace(
        name="fits",
        description="2 GRPO groups x 4 (260+100) and 2 sessions x 3 turns (140/270/400+64)",
        seed=seed,
        server={"num_gpu_blocks": 16, "max_model_len": 1024, "max_num_seqs": 8},
        requests=sorted(reqs, key=lambda r: (r.arrival_s, r.id)),
    )


def oversubscribed_trace(seed: int = 11) -> Trace:
    """16 distinct requests of 100 prompt + 400 generated tokens, 10 ms apart.

    Each needs 4 blocks at the end; 8 running need 32 of the 16 blocks, so
    vLLM must preempt (recompute) and the rest wait.
    """
    rng = random.Random(seed)
    reqs = [
        TraceRequest(
            id=f"r{i:02d}",
            kind="single",
            arrival_s=0.01 * i,
            prompt=_ids(rng, 100),
            max_tokens=400,
        )
        for i in range(16)
    ]
    return Trace(
        name="oversubscribed",
        description="16 x (100 prompt + 400 generated, ignore_eos), all at once",
        seed=seed,
        server={"num_gpu_blocks": 16, "max_model_len": 1024, "max_num_seqs": 8},
        requests=reqs,
    )


def thrash_trace(seed: int = 13) -> Trace:
    """Prefix sharing that the KV cache cannot keep: the hit-rate collapse in miniature.

    8 GRPO groups x 4 samples (260 + 200 tokens) released round-robin (sample
    ``k // 8`` of group ``k % 8`` at ``20 ms x k``, as a trainer interleaves
    groups), plus 4 sessions x 3 turns (140/270/400 + 200 tokens). With 16
    blocks only about four 460-token requests fit, and vLLM admits in arrival
    order, so seven other groups pass through the cache between two samples
    of one group and evict its prefix: the hit rate falls far below ``fits``
    (same shapes) while preemptions and queueing appear (docs/misa-t.md).
    """
    rng = random.Random(seed)
    prompts = [_ids(rng, 260) for _ in range(8)]
    reqs: list[TraceRequest] = [
        TraceRequest(
            id=f"g{k % 8}s{k // 8}",
            kind="grpo",
            arrival_s=0.02 * k,
            prompt=prompts[k % 8],
            max_tokens=200,
        )
        for k in range(32)
    ]
    for sess in range(4):
        prompt = _ids(rng, 140)
        prev: str | None = None
        for turn in range(3):
            if turn:
                prompt = prompt + _ids(rng, 130)
            rid = f"a{sess}t{turn}"
            reqs.append(
                TraceRequest(
                    id=rid,
                    kind="session",
                    arrival_s=0.01 + 0.1 * sess,
                    prompt=list(prompt),
                    max_tokens=200,
                    after=prev,
                    gap_s=0.1 if prev else 0.0,
                )
            )
            prev = rid
    return Trace(
        name="thrash",
        description="8 GRPO groups x 4 (260+200) round-robin and 4 sessions x 3 turns (140/270/400+200)",
        seed=seed,
        server={"num_gpu_blocks": 16, "max_model_len": 1024, "max_num_seqs": 8},
        requests=sorted(reqs, key=lambda r: (r.arrival_s, r.id)),
    )


TRACES: dict[str, Callable[[], Trace]] = {
    "fits": fits_trace,
    "oversubscribed": oversubscribed_trace,
    "thrash": thrash_trace,
}


# ----------------------------------------------------------------------------- metrics


def parse_metrics(text: str, model_name: str | None = None) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets}.

    Summing over the ``engine`` label gives the server-wide figure; samples of
    another ``model_name`` are skipped when one is given. Histogram samples keep
    their ``_sum`` / ``_count`` suffixes; ``_bucket`` and ``_created`` are dropped.
    """
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            if model_name and sample.labels.get("model_name", model_name) != model_name:
                continue
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def delta(after: Mapping[str, float], before: Mapping[str, float], name: str) -> float:
    """Counter increase over the run (0 when the server does not expose it)."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def histogram_means(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    """Mean of each latency histogram over the run, from ``_sum`` / ``_count`` deltas."""
    means: dict[str, float] = {}
    for name in HISTOGRAMS:
        count = delta(after, before, f"{name}_count")
        if count > 0:
            means[name] = delta(after, before, f"{name}_sum") / count
    return means


async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """One ``/metrics`` scrape, parsed."""
    async with session.get(f"{base_url}/metrics") as resp:
        resp.raise_for_status()
        return parse_metrics(await resp.text())


async def reset_prefix_cache(session: aiohttp.ClientSession, base_url: str) -> bool:
    """Empty the server's prefix cache; False when the server lacks the endpoint.

    Without it a second replay of a seeded trace hits the blocks of the first
    (vLLM registers the endpoint only with ``VLLM_SERVER_DEV_MODE=1``).
    """
    async with session.post(f"{base_url}/reset_prefix_cache") as resp:
        return resp.status == 200


async def model_name(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first served model id (``/v1/models``)."""
    async with session.get(f"{base_url}/v1/models") as resp:
        resp.raise_for_status()
        return str((await resp.json())["data"][0]["id"])


# ----------------------------------------------------------------------------- replay


class _Peaks:
    """Running maxima of the gauges, updated by the poller."""

    def __init__(self) -> None:
        self.waiting = 0.0
        self.running = 0.0
        self.kv_usage = 0.0
        self.scrapes = 0
        self.max_gap_s = 0.0
        self._last: float | None = None

    def update(self, metrics: Mapping[str, float], at: float | None = None) -> None:
        self.waiting = max(self.waiting, metrics.get(M_WAITING, 0.0))
        self.running = max(self.running, metrics.get(M_RUNNING, 0.0))
        self.kv_usage = max(self.kv_usage, metrics.get(M_KV_USAGE, 0.0))
        self.scrapes += 1
        if at is not None:
            if self._last is not None:
                self.max_gap_s = max(self.max_gap_s, at - self._last)
            self._last = at


async def _poll(
    session: aiohttp.ClientSession,
    base_url: str,
    peaks: _Peaks,
    stop: asyncio.Event,
    interval_s: float,
) -> None:
    while not stop.is_set():
        # A missed scrape only coarsens the peaks.
        with contextlib.suppress(aiohttp.ClientError):
            peaks.update(await scrape(session, base_url), at=time.monotonic())
        # The poll cadence, not a synchronisation: wakes early when the run ends.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)


async def complete(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    ignore_eos: bool = True,
) -> dict[str, object]:
    """POST one token-id completion (greedy) and return the decoded JSON body."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens,
        "ignore_eos": ignore_eos, "temperature": 0.0, "stream": False,
    }  # fmt: skip
    async with session.post(f"{base_url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        return dict(await resp.json())


async def run_trace(
    base_url: str,
    trace: Trace,
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
    model: str | None = None,
) -> FidelityResult:
    """Replay ``trace`` against ``base_url`` and measure it (see module docstring)."""
    base_url = base_url.rstrip("/").removesuffix("/v1")
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    # A fresh connection per request: uvicorn closes idle keep-alive connections
    # after 5 s, and a session turn sent on one that is just being closed fails
    # with "Server disconnected" (seen in the thrash trace).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = model or await model_name(session, base_url)
        cache_reset = await reset_prefix_cache(session, base_url)
        before = await scrape(session, base_url)
        done = {r.id: asyncio.Event() for r in trace.requests}
        finish_time: dict[str, float] = {}
        records: dict[str, RequestRecord] = {}
        order: list[str] = []
        peaks, stop = _Peaks(), asyncio.Event()
        t0 = time.monotonic()

        async def one(req: TraceRequest) -> None:
            # The trace's own schedule (arrival offsets, session gaps).
            await asyncio.sleep(max(0.0, req.arrival_s - (time.monotonic() - t0)))
            if req.after is not None:
                await done[req.after].wait()
                ready = finish_time[req.after] + req.gap_s
                await asyncio.sleep(max(0.0, ready - (time.monotonic() - t0)))
            sent = time.monotonic() - t0
            try:
                body = await complete(session, base_url, model, req.prompt, req.max_tokens, req.ignore_eos)
                usage = body.get("usage") or {}
                assert isinstance(usage, dict)
                details = usage.get("prompt_tokens_details") or {}
                rec = RequestRecord(
                    id=req.id,
                    sent_s=sent,
                    finished_s=time.monotonic() - t0,
                    prompt_tokens=int(usage.get("prompt_tokens", 0)),
                    cached_tokens=int(details.get("cached_tokens") or 0),
                    completion_tokens=int(usage.get("completion_tokens", 0)),
                )
            except (aiohttp.ClientError, RuntimeError, TimeoutError) as exc:
                rec = RequestRecord(id=req.id, sent_s=sent, finished_s=time.monotonic() - t0, error=str(exc))
            records[req.id] = rec
            finish_time[req.id] = rec.finished_s
            order.append(req.id)
            done[req.id].set()

        poller = asyncio.create_task(_poll(session, base_url, peaks, stop, poll_interval_s))
        try:
            await asyncio.gather(*(one(r) for r in trace.requests))
        finally:
            stop.set()
            await poller
        wall = time.monotonic() - t0
        after = await _settled_scrape(session, base_url, before, len(trace.requests))
        peaks.update(after)

    queries = delta(after, before, M_PREFIX_QUERIES)
    hits = delta(after, before, M_PREFIX_HITS)
    ok = [r for r in records.values() if r.error is None]
    prompt_total = sum(r.prompt_tokens for r in ok)
    return FidelityResult(
        trace=trace.name,
        base_url=base_url,
        cache_reset=cache_reset,
        wall_time_s=round(wall, 4),
        requests=len(trace.requests),
        errors=len(trace.requests) - len(ok),
        hit_rate=hits / queries if queries else None,
        client_hit_rate=(sum(r.cached_tokens for r in ok) / prompt_total) if prompt_total else None,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        preemptions=delta(after, before, M_PREEMPTIONS),
        peak_waiting=peaks.waiting,
        peak_running=peaks.running,
        peak_kv_usage=peaks.kv_usage,
        scrapes=peaks.scrapes,
        max_scrape_gap_s=round(peaks.max_gap_s, 3),
        completion_order=order,
        counters={name: delta(after, before, name) for name in COUNTERS},
        latency_means_s=histogram_means(after, before),
        records=[records[r.id] for r in trace.requests],
    )


async def _settled_scrape(
    session: aiohttp.ClientSession, base_url: str, before: Mapping[str, float], expected: int
) -> dict[str, float]:
    """Scrape until the success counter accounts for every request (bounded).

    vLLM updates its Prometheus counters from the output loop, which can trail
    the last HTTP response by a moment; reading too early undercounts.
    """
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        after = await scrape(session, base_url)
        if delta(after, before, M_SUCCESS) >= expected or M_SUCCESS not in after:
            return after
        if time.monotonic() >= deadline:
            return after
        await asyncio.sleep(0.05)


# ----------------------------------------------------------------------------- calibration


class Calibration(BaseModel):
    """Step-time constants fitted from a real server (seconds).

    Model: one engine step that prefills ``P`` tokens and decodes ``D``
    sequences takes ``step_fixed_s + P * prefill_token_s + D * decode_seq_s``.
    Fitted from the server's own ``vllm:request_decode_time_seconds`` and
    ``vllm:request_prefill_time_seconds`` histograms (so HTTP and detokenizing
    are excluded); ``prefill_fixed_s`` is the prefill fit's intercept, a second
    estimate of the fixed step cost. ``http_overhead_s`` is what a client sees
    on top of the prefill step for a one-token request (API server, HTTP).
    """

    step_fixed_s: float
    decode_seq_s: float
    prefill_token_s: float
    prefill_fixed_s: float
    http_overhead_s: float
    repeats: int
    decode_points: dict[int, float] = Field(description="batch size -> step seconds")
    prefill_points: dict[int, float] = Field(description="prompt tokens -> prefill seconds")
    client_prefill_points: dict[int, float] = Field(
        description="prompt tokens -> client-observed latency of a 1-token request"
    )


def _fit_line(points: Mapping[int, float]) -> tuple[float, float]:
    """Least-squares intercept and slope of y over x."""
    xs, ys = list(points), list(points.values())
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


async def calibrate(
    base_url: str,
    seed: int = 3,
    batches: tuple[int, ...] = (1, 2, 4, 8),
    prompt_lens: tuple[int, ...] = (64, 256, 512, 768, 960),
    decode_tokens: int = 128,
    repeats: int = 5,
) -> Calibration:
    """Measure decode step time per batch size and prefill step time per prompt length.

    Decode: ``b`` concurrent requests with 16-token prompts (prefilled in one
    step, then decoded together) and ``1 + decode_tokens`` output tokens; the
    step time at batch ``b`` is the server's mean decode time per request over
    ``decode_tokens``. Prefill: one request at a time with a fresh random
    prompt of ``L`` tokens and ``max_tokens=1``, whose server-side prefill time
    is one step prefilling ``L`` tokens. Each point is the *minimum* over
    ``repeats``: on a shared machine the noise (other processes taking the
    core) only ever adds time. Needs an otherwise idle server; prompts are
    random, so the prefix cache does not hit.
    """
    base_url = base_url.rstrip("/").removesuffix("/v1")
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = await model_name(session, base_url)

        async def measure(b: int, max_tokens: int, prompt_len: int) -> tuple[float, dict[str, float]]:
            """Client latency of ``b`` concurrent requests and the histogram means."""
            prompts = [_ids(rng, prompt_len) for _ in range(b)]
            before = await scrape(session, base_url)
            t = time.monotonic()
            await asyncio.gather(*(complete(session, base_url, model, p, max_tokens) for p in prompts))
            latency = time.monotonic() - t
            after = await _settled_scrape(session, base_url, before, b)
            return latency, histogram_means(after, before)

        await measure(2, 8, 32)  # warm-up
        decode: dict[int, float] = {}
        for b in batches:
            runs = [await measure(b, 1 + decode_tokens, 16) for _ in range(repeats)]
            decode[b] = min(m[vm.REQUEST_DECODE_TIME.name] for _, m in runs)
            decode[b] /= decode_tokens
        prefill: dict[int, float] = {}
        client_prefill: dict[int, float] = {}
        for n in prompt_lens:
            runs = [await measure(1, 1, n) for _ in range(repeats)]
            prefill[n] = min(m[vm.REQUEST_PREFILL_TIME.name] for _, m in runs)
            client_prefill[n] = min(latency for latency, _ in runs)
    fixed, per_seq = _fit_line(decode)
    prefill_fixed, per_token = _fit_line(prefill)
    client_intercept, _ = _fit_line(client_prefill)
    return Calibration(
        step_fixed_s=fixed,
        decode_seq_s=per_seq,
        prefill_token_s=per_token,
        prefill_fixed_s=prefill_fixed,
        http_overhead_s=client_intercept - prefill_fixed,
        repeats=repeats,
        decode_points=decode,
        prefill_points=prefill,
        client_prefill_points=client_prefill,
    )


# ----------------------------------------------------------------------------- comparison

HIT_RATE_TOLERANCE: float = 0.05
"""Fidelity goal: simulated hit rate within 5 percentage points of the real one."""
PREEMPTION_TOLERANCE: float = 0.20
"""Fidelity goal: simulated preemptions within 20% of the real count."""


def order_distance(a: list[str], b: list[str]) -> float:
    """Normalised Kendall tau distance of two completion orders (0 same, 1 reversed).

    Only ids present in both count; the share of pairs the two orders rank
    differently.
    """
    in_b = set(b)
    common = [x for x in a if x in in_b]
    in_common = set(common)
    pos = {x: i for i, x in enumerate(x for x in b if x in in_common)}
    n = len(common)
    if n < 2:
        return 0.0
    discordant = sum(1 for i in range(n) for j in range(i + 1, n) if pos[common[i]] > pos[common[j]])
    return discordant / (n * (n - 1) / 2)


class Comparison(BaseModel):
    """One trace, real vs simulated, against the fidelity goals (docs/fidelity.md)."""

    trace: str
    real_hit_rate: float | None
    sim_hit_rate: float | None
    hit_rate_ok: bool
    real_preemptions: float
    sim_preemptions: float
    preemptions_ok: bool
    real_peak_waiting: float
    sim_peak_waiting: float
    same_pressure: bool = Field(description="both preempt and queue, or neither does (the collapse reproduces)")
    order_distance: float


def compare(real: FidelityResult, sim: FidelityResult) -> Comparison:
    """Check ``sim`` against ``real`` for one trace (same trace name required)."""
    if real.trace != sim.trace:
        raise ValueError(f"different traces: {real.trace!r} vs {sim.trace!r}")
    rh, sh = real.hit_rate or 0.0, sim.hit_rate or 0.0
    if real.preemptions:
        pre_ok = abs(sim.preemptions - real.preemptions) <= PREEMPTION_TOLERANCE * real.preemptions
    else:
        pre_ok = sim.preemptions == 0
    pressured = (real.preemptions > 0, real.peak_waiting > 0)
    return Comparison(
        trace=real.trace,
        real_hit_rate=real.hit_rate,
        sim_hit_rate=sim.hit_rate,
        hit_rate_ok=abs(rh - sh) <= HIT_RATE_TOLERANCE,
        real_preemptions=real.preemptions,
        sim_preemptions=sim.preemptions,
        preemptions_ok=pre_ok,
        real_peak_waiting=real.peak_waiting,
        sim_peak_waiting=sim.peak_waiting,
        same_pressure=pressured == (sim.preemptions > 0, sim.peak_waiting > 0),
        order_distance=round(order_distance(real.completion_order, sim.completion_order), 4),
    )


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """CLI: replay a named trace (or ``--calibrate``) and print / save the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="e.g. http://127.0.0.1:8100")
    parser.add_argument("--trace", choices=sorted(TRACES), default="fits")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--poll-interval", type=float, default=DEFAULT_POLL_INTERVAL_S)
    parser.add_argument("--calibrate", action="store_true", help="measure step-time constants")
    parser.add_argument("--repeats", type=int, default=5, help="calibration repeats per point")
    parser.add_argument(
        "--compare", nargs=2, type=Path, metavar=("REAL_JSON", "SIM_JSON"),
        help="compare two saved results of one trace against the fidelity goals",
    )  # fmt: skip
    args = parser.parse_args(argv)
    result: BaseModel
    if args.compare:
        real, sim = (FidelityResult.model_validate_json(p.read_text()) for p in args.compare)
        cmp = compare(real, sim)
        print(cmp.model_dump_json(indent=2))
        return 0 if cmp.hit_rate_ok and cmp.preemptions_ok and cmp.same_pressure else 1
    if not args.base_url:
        parser.error("--base-url is required unless --compare is given")
    if args.calibrate:
        result = asyncio.run(calibrate(args.base_url, repeats=args.repeats))
    else:
        result = asyncio.run(run_trace(args.base_url, TRACES[args.trace](), args.poll_interval))
    text = result.model_dump_json(indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    summary = result.model_dump(exclude={"records", "counters"})
    print(json.dumps(summary, indent=2, default=str))
    return 1 if isinstance(result, FidelityResult) and result.errors else 0


if __name__ == "__main__":
    sys.exit(main())
