"""The MISA-T router in front of two real vLLM CPU servers (``make e2e``).

Why: the router's unit tests talk to a fake engine written from our reading of
vLLM. Here the router (the app from ``create_app``, served by ``start_service`` on a
free port, exactly as ``misat router`` serves it) fronts the session's two real vLLM servers
(``conftest.vllm_servers``: tiny model, 16 KV blocks of 128 tokens,
``--max-model-len 1024``, ``--max-num-seqs 8``, prefix caching on). Each test
gets a fresh router, so its counters belong to that test alone; the engines
are shared, so engine figures are always deltas of their ``/metrics``.

What is proven against the real server: the OpenAI surface through the router
(official ``openai`` client: token-id and text prompts, chat, streaming usage,
vLLM's own 400 passed through), a trainer-emulator run whose token accounting
and hit rate agree with the engines' counters, MISA-T holding sessions under
KV pressure with fewer engine preemptions than least-loaded on the same trace,
a hot reload while streams are open, and an engine killed mid-run (last: it
destroys one of the shared servers).

Unmarked tests check the pure parts (configs, workload sizing) in ``make test``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from misat_bench.fidelity import M_PREEMPTIONS, M_PREFIX_HITS, M_PREFIX_QUERIES, M_SUCCESS, parse_metrics
from misat_bench.real_vllm import CPU_BLOCK_SIZE, RunningServer
from misat_router.app import create_app
from misat_router.config import RouterConfig
from misat_router.scrape import cancel_all
from misat_router.service import start_service
from misat_router.state import STATE
from misat_sim.trainer import Trainer, TrainerConfig
from misat_sim.workload import AgenticShape, RolloutClass, Workload, WorkloadSpec
from tests.support.router_config import router_config as shared_router_config

MODEL = "tiny"
MAX_MODEL_LEN = 1024
"""The session servers' ``--max-model-len`` (conftest: ``default_specs``)."""
KV_CAPACITY_TOKENS = 16 * CPU_BLOCK_SIZE
"""Per engine: 16 blocks x 128 tokens."""
ADMIN_TOKEN = "e2e-admin-token"

READY_TIMEOUT_S = 30.0
"""Router start: both engines healthy and scraped (a scrape every 0.25 s)."""
SETTLE_TIMEOUT_S = 30.0
"""After load stops: engine counters and router accounting settle within this."""
POLL_S = 0.1
"""Spacing of every bounded poll of a condition."""

HIT_RATE_TOLERANCE = 0.02
"""Run hit rate from the engines' counter deltas vs the router's usage-based figure.
Both count whole 128-token blocks of the same requests; they differ only when a
request is preempted (vLLM leaves re-lookups of preempted requests out of the
counters, docs/fidelity.md), so 2 points is ample."""
STATUS_TOLERANCE = 1e-6
"""/status vs the engines' own cumulative counters once load has stopped: exact."""


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


# ----------------------------------------------------------------------------- configs

E2E_CLASSES = (
    {"name": "agentic", "share": 48.6, "multi_turn": True, "bootstrap_footprint_tokens": 512},
    {"name": "rlvr", "share": 33.1, "bootstrap_footprint_tokens": 512},
    {"name": "rlhf", "share": 18.3, "bootstrap_footprint_tokens": 256},
)


def router_config(urls: list[str], policy: str = "misa-t", generation: int = 1, **policy_knobs: Any) -> RouterConfig:
    """The router config of every test: three classes, CPU block size, slow-machine timeouts.

    Footprint priors are in this workload's tokens (a GRPO sample of about 500
    tokens), so MISA-T's caps are right from the first request: floor(2048 x 0.9
    / 512) = 3 sessions per engine, 12 of the 16 blocks.
    """
    return shared_router_config(
        urls,
        policy=policy,
        policy_settings={"prefix": {"block_size": CPU_BLOCK_SIZE}, **policy_knobs},
        epoch_s=None,
        fast=False,
        model=MODEL,
        classes=E2E_CLASSES,
        default_class="rlvr",
        generation=generation,
        scrape_interval_s=0.25,
        # A loaded 2-core machine answers /health and /metrics late; a dead
        # engine still leaves rotation at once through connection errors.
        scrape_timeout_s=5.0,
        health_interval_s=0.5,
        health_timeout_s=5.0,
        unhealthy_after_failures=2,
        hold_deadline_s=240.0,
        drain_timeout_s=5.0,
    )


def trainer_spec() -> WorkloadSpec:
    """The paper's mixture at 1/128 scale so every request fits ``--max-model-len 1024``.

    Context limit round(120,000 x 1/128) = 938 tokens (prompt + output, every turn);
    GRPO groups of 4; prompts at 1/4 scale (tens to hundreds of tokens); about
    6-10 agentic turns (``turn_scale`` 0.1), whose growing contexts are what
    the prefix cache serves.
    """
    return WorkloadSpec(
        seed=7,
        length_scale=1 / 128,
        prompt_scale=1 / 4,
        max_context_tokens=120_000,
        vocab_size=2048,
        group_size={RolloutClass.RLVR: 4, RolloutClass.RLHF: 4},
        agentic=AgenticShape(turn_scale=0.1),
        session_prefix="e2e-trainer",
    )


TRAINER_UNITS = 24


def test_router_config_is_valid_and_sized_for_the_cpu_engines() -> None:
    cfg = router_config(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert cfg.policy.name.value == "misa-t"
    assert cfg.policy.prefix.block_size == CPU_BLOCK_SIZE
    assert {c.name for c in cfg.workloads.classes} == {c.value for c in RolloutClass}
    rlvr = cfg.workloads.get("rlvr")
    assert rlvr is not None and rlvr.bootstrap_footprint_tokens is not None
    # Three 100+400-token sessions per engine: 12 of its 16 blocks, so no preemption.
    cap = int(KV_CAPACITY_TOKENS * cfg.policy.kv_budget_fraction // rlvr.bootstrap_footprint_tokens)
    assert cap == 3
    assert cap * -(-500 // CPU_BLOCK_SIZE) <= 16
    assert router_config(["http://x:1"], policy="least-loaded").policy.name.value == "least-loaded"


def test_trainer_workload_fits_the_engines_and_mixes_all_classes() -> None:
    workload = Workload(trainer_spec())
    plans = []
    while len(plans) < TRAINER_UNITS:
        plans.extend(workload.draw())
    assert {p.klass for p in plans} == set(RolloutClass)
    for plan in plans:
        for prompt_len, turn in zip(plan.planned_prompt_lens(), plan.turns, strict=True):
            assert prompt_len + turn.max_tokens <= MAX_MODEL_LEN - 64, plan.session_id
    agentic = [p for p in plans if p.klass is RolloutClass.AGENTIC]
    # Multi-turn contexts pass a full KV block, so the prefix cache has something to serve.
    assert max(max(p.planned_prompt_lens()) for p in agentic) > 2 * CPU_BLOCK_SIZE


# ----------------------------------------------------------------------------- harness


@dataclass
class Router:
    """A running in-process router: its base URL and app."""

    url: str
    app: web.Application
    http: aiohttp.ClientSession
    clients: list[Any] = field(default_factory=list)
    """The OpenAI clients ``openai()`` made: ``running_router`` closes them (see ``openai``)."""

    async def status(self) -> dict[str, Any]:
        async with self.http.get(f"{self.url}/status") as resp:
            assert resp.status == 200
            return dict(await resp.json())

    async def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        from prometheus_client.parser import text_string_to_metric_families

        async with self.http.get(f"{self.url}/metrics") as resp:
            text = await resp.text()
        return [(s.name, dict(s.labels), float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples]

    async def metric_sum(self, name: str, **labels: str) -> float:
        return sum(
            v for n, lab, v in await self.metrics() if n == name and all(lab.get(k) == x for k, x in labels.items())
        )

    def openai(self, **kw: Any) -> Any:
        """An official OpenAI client of this router, closed when the ``running_router`` block ends.

        Why closed, and not left to the garbage collector: the router shares this event loop. An
        unclosed client found in a reference cycle has its sockets closed by the collector (the
        asyncio transports' finalisers) while the client's own finaliser schedules its ``aclose``,
        which later unregisters those file descriptors from the loop. By then the router may have
        accepted a new connection on one of the same numbers, whose request is then never read.
        Seen as a request the router never saw, the client timing out (docs/e2e.md).
        """
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=300.0, **kw)
        self.clients.append(client)
        return client


async def poll_until(
    check: Callable[[], Awaitable[bool]], timeout_s: float, what: Callable[[], Awaitable[str]] | str
) -> None:
    """Re-check ``check()`` every ``POLL_S`` until it holds; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() >= deadline:
            detail = what if isinstance(what, str) else await what()
            pytest.fail(f"not reached within {timeout_s:g} s: {detail}", pytrace=False)
        await asyncio.sleep(POLL_S)


@asynccontextmanager
async def running_router(config: RouterConfig) -> AsyncIterator[Router]:
    """Serve ``create_app(config)`` on a free port (as ``misat router`` does) until the block ends.

    Ready means: both engines healthy and scraped (MISA-T needs their KV capacity).
    """
    app = create_app(config, admin_token=ADMIN_TOKEN)
    service = await start_service(app)
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    router = Router(url=service.url, app=app, http=http)
    try:
        n = len(config.engines.urls or ())

        async def ready() -> bool:
            st = await router.status()
            return st["healthy_engines"] == n and all(e["kv_capacity_tokens"] > 0 for e in st["engines"])

        await poll_until(ready, READY_TIMEOUT_S, lambda: _status_brief(router))
        yield router
    finally:
        for client in router.clients:
            await client.close()
        await http.close()
        await service.stop()


async def _true(value: bool) -> bool:
    """``value`` as the awaitable ``poll_until`` checks."""
    return value


async def _status_brief(router: Router) -> str:
    st = await router.status()
    keys = ("generation", "healthy_engines", "requests_in_flight", "held_requests")
    return str({k: st[k] for k in keys} | {"classes": st["classes"], "engines": st["engines"]})


async def engine_counters(http: aiohttp.ClientSession, urls: list[str]) -> dict[str, dict[str, float]]:
    """Every engine's vLLM counters (model ``tiny``), by base URL."""
    out = {}
    for url in urls:
        async with http.get(f"{url}/metrics") as resp:
            out[url] = parse_metrics(await resp.text(), model_name=MODEL)
    return out


def _delta(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]], name: str) -> float:
    return sum(after[u].get(name, 0.0) - before[u].get(name, 0.0) for u in after)


async def wait_engines_served(
    http: aiohttp.ClientSession, urls: list[str], before: dict[str, dict[str, float]], requests: int
) -> dict[str, dict[str, float]]:
    """Engine counters once ``vllm:request_success_total`` accounts for ``requests`` more."""
    latest: dict[str, dict[str, float]] = {}

    async def done() -> bool:
        nonlocal latest
        latest = await engine_counters(http, urls)
        return _delta(latest, before, M_SUCCESS) >= requests

    await poll_until(done, SETTLE_TIMEOUT_S, lambda: _served_brief(latest, before, requests))
    return latest


async def _served_brief(latest: dict[str, dict[str, float]], before: dict[str, dict[str, float]], n: int) -> str:
    return f"engines finished {_delta(latest, before, M_SUCCESS):g} of {n} requests"


async def reset_prefix_caches(http: aiohttp.ClientSession, urls: list[str]) -> None:
    """Empty every engine's prefix cache (``VLLM_SERVER_DEV_MODE=1`` registers the endpoint)."""
    for url in urls:
        async with http.post(f"{url}/reset_prefix_cache") as resp:
            assert resp.status == 200, await resp.text()


async def wait_drained(router: Router, healthy_engines: int | None = None) -> dict[str, Any]:
    """Bounded poll until the router holds nothing: no request in flight or held, no live session."""
    last: dict[str, Any] = {}

    async def drained() -> bool:
        nonlocal last
        last = await router.status()
        return (
            last["requests_in_flight"] == 0
            and last["held_requests"] == 0
            and all(c["active_sessions"] == 0 and c["held_requests"] == 0 for c in last["classes"])
            and all(e["in_flight"] == 0 for e in last["engines"])
            and (healthy_engines is None or last["healthy_engines"] == healthy_engines)
        )

    await poll_until(drained, SETTLE_TIMEOUT_S, lambda: _status_brief(router))
    return last


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    yield session
    await session.close()


# ----------------------------------------------------------------------------- OpenAI surface


@pytest.mark.e2e
async def test_openai_client_through_the_router(vllm_base_urls: list[str], http: aiohttp.ClientSession) -> None:
    import openai

    async with running_router(router_config(vllm_base_urls)) as router:
        client = router.openai()
        labels = {"X-Rollout-Class": "rlvr", "X-Session-Id": "basic-ids"}

        # Token-id prompt: exact usage, vLLM's token ids, and which engine served it.
        prompt = _ids(11, 20)
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True}, extra_headers=labels,
        )  # fmt: skip
        assert raw.headers["X-Misat-Engine"] in vllm_base_urls
        resp = raw.parse()
        assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (20, 8)
        assert resp.choices[0].model_extra["prompt_token_ids"] == prompt
        assert len(resp.choices[0].model_extra["token_ids"]) == 8

        # Rollout metadata in the body: the router strips it (vLLM refuses unknown fields).
        resp = await client.completions.create(
            model=MODEL, prompt=_ids(12, 30), max_tokens=4, temperature=0.0,
            extra_body={"ignore_eos": True, "rollout": {"class": "rlhf", "session_id": "basic-body"}},
        )  # fmt: skip
        assert resp.usage.completion_tokens == 4

        # Text prompt (default class) through the local tokenizer.
        resp = await client.completions.create(
            model=MODEL, prompt="t5 t6 t700", max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert resp.usage.prompt_tokens == 3
        assert resp.choices[0].text.split()

        # Chat with the model's chat template.
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "t10 t11 t12"}], max_tokens=5,
            temperature=0.0, extra_body={"ignore_eos": True}, extra_headers={"X-Rollout-Class": "rlhf"},
        )  # fmt: skip
        assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (6, 5)
        assert chat.choices[0].message.role == "assistant"

        # Streaming with usage in the last chunk, relayed chunk by chunk.
        stream = await client.completions.create(
            model=MODEL, prompt=_ids(13, 12), max_tokens=10, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert stream.response.headers["X-Misat-Engine"] in vllm_base_urls
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (12, 10)
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2

        # vLLM's own error (prompt + max_tokens over --max-model-len) is passed through unchanged.
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(model=MODEL, prompt=_ids(14, MAX_MODEL_LEN + 10), max_tokens=4)
        assert err.value.status_code == 400
        assert err.value.response.headers.get("X-Misat-Engine") in vllm_base_urls

        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]

        # The router's books: 5 answers from engines, 1 engine error, tokens from usage.
        assert await router.metric_sum("misat_requests_total", outcome="ok") == 5
        assert await router.metric_sum("misat_requests_total", outcome="engine_error") == 1
        assert await router.metric_sum("misat_tokens_total", kind="completion") == 8 + 4 + 6 + 5 + 10
        status = await wait_drained(router)
        assert sum(c["completed_units"] for c in status["classes"]) == 5
        assert status["policy"] == "misa-t"


# ----------------------------------------------------------------------------- trainer emulator


@pytest.mark.e2e
async def test_trainer_mixed_run_agrees_with_engine_counters(
    vllm_base_urls: list[str], http: aiohttp.ClientSession, record_figure: Callable[[str, object], None]
) -> None:
    spec = trainer_spec()
    async with running_router(router_config(vllm_base_urls)) as router:
        before = await engine_counters(http, vllm_base_urls)
        cfg = TrainerConfig(
            base_url=router.url, model=MODEL, mode="continuous", max_units=TRAINER_UNITS, max_in_flight=12,
            request_timeout_s=300.0, max_retries=20,
        )  # fmt: skip
        started = time.monotonic()
        async with asyncio.timeout(600):
            report = await Trainer(cfg, spec).run()
        wall_s = time.monotonic() - started

        # Every unit completes, with vLLM's real output ids feeding the next turn.
        assert report.errors == 0, report.error_examples
        assert report.units_released == report.units_completed == TRAINER_UNITS
        assert report.missing_token_ids == 0
        assert {k for k, v in report.per_class.items() if v.units} == set(RolloutClass)

        after = await wait_engines_served(http, vllm_base_urls, before, report.requests)
        queries = _delta(after, before, M_PREFIX_QUERIES)
        hits = _delta(after, before, M_PREFIX_HITS)
        engine_hit_rate = hits / queries
        preemptions = _delta(after, before, M_PREEMPTIONS)

        # The router's token books are the engines' usage: cached tokens exactly; prompt tokens
        # exactly unless an attempt failed and was placed again (the router also counts the
        # failed attempt's prompt estimate; seen when vLLM closes an idle pooled connection).
        router_prompt = await router.metric_sum("misat_tokens_total", kind="prompt")
        router_cached = await router.metric_sum("misat_tokens_total", kind="cached")
        retried = await router.metric_sum("misat_requests_total", outcome="retried")
        assert router_cached == report.cached_tokens
        assert report.prompt_tokens <= router_prompt <= report.prompt_tokens + retried * MAX_MODEL_LEN
        assert queries <= report.prompt_tokens  # preempted re-lookups are left out of vLLM's counter
        client_hit_rate = report.cached_tokens / report.prompt_tokens
        assert client_hit_rate == pytest.approx(engine_hit_rate, abs=HIT_RATE_TOLERANCE)
        router_hit_rate = router_cached / router_prompt
        if retried == 0:
            assert router_hit_rate == pytest.approx(engine_hit_rate, abs=HIT_RATE_TOLERANCE)
        # Agentic turns re-send their whole context; MISA-T keeps a session on one engine.
        assert engine_hit_rate > 0.05

        # /status reports the engines' cumulative counters; once load stopped they agree exactly.
        cumulative = sum(after[u][M_PREFIX_HITS] for u in after) / sum(after[u][M_PREFIX_QUERIES] for u in after)
        status: dict[str, Any] = {}

        async def status_caught_up() -> bool:
            nonlocal status
            status = await router.status()
            rate = status["prefix_hit_rate"]
            return rate is not None and abs(rate - cumulative) <= STATUS_TOLERANCE

        await poll_until(status_caught_up, SETTLE_TIMEOUT_S, lambda: _rate_brief(status, cumulative))
        for engine in status["engines"]:
            counters = after[engine["id"]]
            assert engine["prefix_hit_rate"] == pytest.approx(
                counters[M_PREFIX_HITS] / counters[M_PREFIX_QUERIES], abs=STATUS_TOLERANCE
            )
            assert engine["preemptions_total"] == counters[M_PREEMPTIONS]

        # Accounting drains: finished units leave no session, nothing in flight or held.
        status = await wait_drained(router)
        completed = {c["name"]: c["completed_units"] for c in status["classes"]}
        assert completed == {k.value: v.units for k, v in report.per_class.items()}
        record_figure("units", report.units_completed)
        record_figure("requests", report.requests)
        record_figure("wall_s", round(wall_s, 1))
        record_figure("engine_hit_rate_delta", round(engine_hit_rate, 4))
        record_figure("client_hit_rate_from_usage", round(client_hit_rate, 4))
        record_figure("router_hit_rate_from_usage", round(router_hit_rate, 4))
        record_figure("router_retried_attempts", retried)
        record_figure("status_hit_rate_cumulative", round(status["prefix_hit_rate"], 6))
        record_figure("engines_hit_rate_cumulative", round(cumulative, 6))
        record_figure("engine_preemptions", preemptions)
        record_figure("mixture_tv_points", round(status["mixture_tv_points"], 1))


def _rate_brief(status: dict[str, Any], cumulative: float) -> str:
    return f"/status prefix_hit_rate {status.get('prefix_hit_rate')} vs engines' cumulative {cumulative}"


# ----------------------------------------------------------------------------- KV pressure

PRESSURE_REQUESTS = 24
PRESSURE_PROMPT = 100
PRESSURE_OUTPUT = 400
"""24 GRPO-style samples of 100 + 400 tokens (4 blocks each) on two engines of 16
blocks: 12 per engine under least-loaded, which vLLM runs 8 at a time and must
preempt; MISA-T admits 3 per engine (12 blocks) and holds the rest."""


@dataclass
class PressureRun:
    policy: str
    preemptions: float
    held_total: float
    peak_held: int
    peak_running: int
    wall_s: float
    outputs: list[int] = field(default_factory=list)


@dataclass
class Trail:
    """Where one request of the trace was, as the client and the router's own state saw it
    (seconds from the trace's start; None: never)."""

    sent: float | None = None
    answered: float | None = None
    held_first: float | None = None
    held_last: float | None = None
    placed: float | None = None
    engine: str | None = None
    in_flight_last: float | None = None

    def brief(self) -> str:
        parts = [f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                 for k, v in vars(self).items() if v is not None]
        return ", ".join(parts) or "never sent"


def _trail_lines(trails: dict[str, Trail], now: float) -> str:
    """The requests without an answer, each with its trail, and how many the router never saw."""
    late = {sid: t for sid, t in trails.items() if t.answered is None}
    unseen = sum(1 for t in late.values() if t.held_first is None and t.placed is None)
    lines = [f"{sid}: {t.brief()}" for sid, t in sorted(late.items())]
    return (f"at {now:.1f} s, {len(late)} unanswered ({unseen} never seen by the router, held or "
            f"in flight): " + "; ".join(lines))


async def run_pressure(policy: str, urls: list[str], http: aiohttp.ClientSession) -> PressureRun:
    """The same seeded trace through a fresh router with ``policy``; engine deltas around it."""
    await reset_prefix_caches(http, urls)
    async with running_router(router_config(urls, policy=policy)) as router:
        client = router.openai()
        before = await engine_counters(http, urls)
        peak_held = peak_running = 0
        stop = asyncio.Event()
        state = router.app[STATE]
        trails = {f"pressure-{policy}-{i}": Trail() for i in range(PRESSURE_REQUESTS)}
        started = time.monotonic()

        def look() -> None:
            """Each request's place in the router (its in-process state: exact, and no HTTP)."""
            t = time.monotonic() - started
            for entry in state.runner.held():
                trail = trails.get(entry.req.session_id or "")
                if trail is not None:
                    trail.held_first = t if trail.held_first is None else trail.held_first
                    trail.held_last = t
            for flight in state.dispatcher.in_flight.values():
                trail = trails.get(flight.meta.session_id or "")
                if trail is not None:
                    trail.placed = t if trail.placed is None else trail.placed
                    trail.engine, trail.in_flight_last = flight.engine_id, t

        async def sample() -> None:  # figures and the failure's trail only: the assertions use counters
            nonlocal peak_held, peak_running
            while not stop.is_set():
                look()
                st = await router.status()
                peak_held = max(peak_held, st["held_requests"])
                peak_running = max(peak_running, sum(e["running"] for e in st["engines"]))
                await asyncio.sleep(0.25)

        async def one(i: int) -> int:
            trail = trails[f"pressure-{policy}-{i}"]
            trail.sent = time.monotonic() - started
            resp = await client.completions.create(
                model=MODEL, prompt=_ids(1000 + i, PRESSURE_PROMPT), max_tokens=PRESSURE_OUTPUT,
                temperature=0.0, extra_body={"ignore_eos": True},
                extra_headers={"X-Rollout-Class": "rlvr", "X-Session-Id": f"pressure-{policy}-{i}"},
            )  # fmt: skip
            trail.answered = time.monotonic() - started
            return int(resp.usage.completion_tokens)

        sampler = asyncio.create_task(sample())
        try:
            async with asyncio.timeout(400):
                outputs = await asyncio.gather(*(one(i) for i in range(PRESSURE_REQUESTS)))
        except (TimeoutError, openai.APITimeoutError) as exc:
            # The trail says whether a late request was held by the router, ran on an engine, or never
            # reached it; it is how an unclosed client deafening the router's sockets was found (docs/e2e.md).
            st = await router.status()
            raise AssertionError(
                f"{policy}: a request did not finish in time; "
                f"{_trail_lines(trails, time.monotonic() - started)}; router now: held {st['held_requests']} "
                f"{st['held_by_reason']}, waiters {state.dispatcher.held_waiters()}, in flight "
                f"{st['requests_in_flight']}; engines (in flight, running, waiting, KV use): "
                f"{[(e['id'], e['in_flight'], e['running'], e['waiting'], e['kv_usage']) for e in st['engines']]}"
            ) from exc
        finally:
            stop.set()
            await sampler
        wall_s = time.monotonic() - started
        after = await wait_engines_served(http, urls, before, PRESSURE_REQUESTS)
        held_total = await router.metric_sum("misat_requests_held_total")
        await wait_drained(router)
    return PressureRun(
        policy=policy, preemptions=_delta(after, before, M_PREEMPTIONS), held_total=held_total,
        peak_held=peak_held, peak_running=peak_running, wall_s=round(wall_s, 1), outputs=list(outputs),
    )  # fmt: skip


@pytest.mark.e2e
async def test_kv_pressure_misa_t_holds_and_preempts_less_than_least_loaded(
    vllm_base_urls: list[str], http: aiohttp.ClientSession, record_figure: Callable[[str, object], None]
) -> None:
    least = await run_pressure("least-loaded", vllm_base_urls, http)
    misa = await run_pressure("misa-t", vllm_base_urls, http)
    for run in (least, misa):
        record_figure(run.policy, {k: v for k, v in vars(run).items() if k != "outputs"})
        assert run.outputs == [PRESSURE_OUTPUT] * PRESSURE_REQUESTS
    # Least-loaded forwards everything at once: the pool is oversubscribed and vLLM preempts.
    assert least.held_total == 0
    assert least.preemptions > 0
    # MISA-T keeps each engine's sessions inside its KV budget and holds the rest.
    assert misa.held_total > 0
    assert misa.preemptions < least.preemptions


# ----------------------------------------------------------------------------- hot reload

RELOAD_STREAMS = 8
RELOAD_OUTPUT = 600
"""100 + 600 tokens a stream: MISA-T admits 2 per engine (footprint about 700 of a
1843-token budget) and holds 4; long enough that the reload lands mid-stream."""


@pytest.mark.e2e
async def test_a_restarted_router_sends_continuations_back_to_their_cached_blocks(
    vllm_base_urls: list[str], http: aiohttp.ClientSession
) -> None:
    """vLLM keeps a session's KV through a router restart. The new router has never seen the
    session: a continuation naming its engine (``X-Session-Engine``, the ``X-Misat-Engine`` of its
    last answer, as misat_client sends it) goes back there and finds its prompt's blocks; one
    without it goes to the cheapest engine and computes its prompt again."""
    prompts = {f"restart-{i}": _ids(9100 + i, 300) for i in range(2)}

    async def turn(router: Router, sid: str, n: int, prompt: list[int], engine: str | None = None) -> tuple[str, int]:
        headers = {"X-Rollout-Class": "agentic", "X-Session-Id": sid, "X-Session-Turn": str(n),
                   "X-Session-End": "true" if n else "false"}
        if engine is not None:
            headers["X-Session-Engine"] = engine
        async with http.post(f"{router.url}/v1/completions", headers=headers,
                             json={"model": MODEL, "prompt": prompt, "max_tokens": 4}) as resp:
            body = await resp.json()
            assert resp.status == 200, body
            details = body["usage"].get("prompt_tokens_details") or {}
            return resp.headers["X-Misat-Engine"], int(details.get("cached_tokens") or 0)

    async with running_router(router_config(vllm_base_urls)) as first:
        # Both first turns at once: the second is placed while the first is in flight, elsewhere.
        served = await asyncio.gather(*(turn(first, sid, 0, p) for sid, p in prompts.items()))
    engine_of = {sid: engine for sid, (engine, _) in zip(prompts, served, strict=True)}
    assert set(engine_of.values()) == set(vllm_base_urls), engine_of

    cheapest = min(vllm_base_urls)  # two idle engines, nothing known: the cost tie goes to the lower id
    unhinted = next(sid for sid, engine in engine_of.items() if engine != cheapest)
    hinted = next(sid for sid in prompts if sid != unhinted)
    async with running_router(router_config(vllm_base_urls)) as second:
        engine, cached = await turn(second, unhinted, 1, prompts[unhinted] + _ids(1, 40))
        assert (engine, cached) == (cheapest, 0)
        engine, cached = await turn(second, hinted, 1, prompts[hinted] + _ids(2, 40), engine_of[hinted])
        assert engine == engine_of[hinted] and cached >= 2 * CPU_BLOCK_SIZE  # 300 tokens: two full blocks
        assert await second.metric_sum("misat_decisions_total", reason="continuation_hinted") == 1
        assert await second.metric_sum("misat_decisions_total", reason="continuation_moved") == 1
        await wait_drained(second)


@pytest.mark.e2e
async def test_hot_reload_of_admission_settings_keeps_open_streams(
    vllm_base_urls: list[str], http: aiohttp.ClientSession, record_figure: Callable[[str, object], None]
) -> None:
    config = router_config(vllm_base_urls)
    async with running_router(config) as router:
        client = router.openai()
        first_chunks = finished = 0

        async def stream(i: int) -> tuple[int, int]:
            nonlocal first_chunks, finished
            s = await client.completions.create(
                model=MODEL, prompt=_ids(2000 + i, 100), max_tokens=RELOAD_OUTPUT, temperature=0.0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                extra_headers={"X-Rollout-Class": "rlvr", "X-Session-Id": f"reload-{i}"},
            )  # fmt: skip
            events = usage = 0
            async for chunk in s:
                if chunk.choices:
                    events += 1
                    if events == 1:
                        first_chunks += 1
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            finished += 1
            return events, usage

        tasks = [asyncio.create_task(stream(i)) for i in range(RELOAD_STREAMS)]
        try:

            # Streams are open once the router has forwarded them (the client may read late on a
            # loaded machine, so the router's own count is the truth); the rest may be held.
            # Woken by the router itself the moment the second one is forwarded (a 0.1 s poll
            # missed whole waves of streams on a fast machine), so the reload lands with most of
            # their tokens still to come.
            state = router.app[STATE]
            try:
                await state.wait_until(lambda: len(state.dispatcher.in_flight) >= 2 and finished == 0, 60.0)
            except TimeoutError:
                pytest.fail(f"streams not open: {first_chunks} answering, {finished} finished; "
                            f"{await _status_brief(router)}", pytrace=False)
            before = {"requests_in_flight": len(state.dispatcher.in_flight), "held_requests": state.runner.held_count()}

            new = config.model_dump(mode="json")
            new["generation"] = config.generation + 1
            new["policy"]["kv_budget_fraction"] = 0.6
            new["policy"]["admission"]["epoch_s"] = 0.25
            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            async with http.put(f"{router.url}/admin/config", json=new, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()
            during = await router.status()
            async with asyncio.timeout(300):
                results = await asyncio.gather(*tasks)
        finally:
            await cancel_all(tasks)

        # Knobs apply in place (what the policy learned survives) or by a rebuild; either way applied.
        assert answer["applied"] is True and "policy" in answer["changes"]
        assert answer["generation"] == config.generation + 1
        assert during["generation"] == config.generation + 1
        # The reload happened with streams open: counted by the router in the same step as the apply.
        assert answer["requests_in_flight"] > 0, (answer, before, during)
        # Every stream ran to its end, usage included, across the reload.
        assert [u for _, u in results] == [RELOAD_OUTPUT] * RELOAD_STREAMS
        # Relayed as events (vLLM coalesces tokens into fewer events when its API server lags).
        assert all(events >= 1 for events, _ in results)
        status = await wait_drained(router)
        assert status["generation"] == config.generation + 1
        assert status["config_hash"] == answer["config_hash"] != config.config_hash()
        assert status["last_reload_error"] is None
        assert await router.metric_sum("misat_config_reloads_total", source="admin", result="applied") == 1
        async with http.get(f"{router.url}/admin/config", headers=headers) as resp:
            applied = (await resp.json())["config"]
        assert applied["policy"]["kv_budget_fraction"] == 0.6
        assert applied["policy"]["admission"]["epoch_s"] == 0.25
        assert await router.metric_sum("misat_requests_total", outcome="ok") == RELOAD_STREAMS
        record_figure("in_flight_before_reload", before["requests_in_flight"])
        record_figure("held_before_reload", before["held_requests"])
        record_figure("in_flight_at_reload", answer["requests_in_flight"])
        record_figure("held_at_reload", answer["held_requests"])
        record_figure("policy_rebuilt", answer["policy_rebuilt"])


# ----------------------------------------------------------------------------- keep pause

KEEP_STREAMS = 4
KEEP_OUTPUT = 700
"""The longer the streams, the later a slow machine can pause and still find them running; but two
of them (100 + 700 tokens, 7 blocks each) leave room in an engine's 16 blocks. At 900 two took all
16, and KV-pressure preemptions (3-4 a run) counted toward what the reset must preempt."""


@pytest.mark.e2e
async def test_a_keep_pause_freezes_streams_on_real_vllm_and_the_resume_finishes_them(
    vllm_base_urls: list[str], http: aiohttp.ClientSession, record_figure: Callable[[str, object], None]
) -> None:
    """``/admin/pause?mode=keep`` through vLLM's own ``/pause?mode=keep``: the engines serving a
    stream report themselves paused, nothing is aborted; the resume resets prefix caches with
    ``reset_running_requests`` (the frozen requests' KV is the old weights'), so vLLM preempts
    them; then every stream ends with all its tokens."""
    before = await engine_counters(http, vllm_base_urls)
    async with running_router(router_config(vllm_base_urls)) as router:
        generating: set[int] = set()
        finished: set[int] = set()
        two_generating = asyncio.Event()

        async def stream(i: int) -> tuple[list[str | None], int]:
            # Read raw, not through the openai client: on a loaded machine that client's per-chunk
            # work put it seconds behind the router, and a run paused when it had seen four streams
            # begin while the router had already relayed all four to their end. A raw reader keeps
            # the router's pace (the router runs in this process, on this loop).
            body = {"model": MODEL, "prompt": _ids(3000 + i, 100), "max_tokens": KEEP_OUTPUT, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            reasons: list[str | None] = []
            usage = 0
            async with http.post(f"{router.url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=300),
                                 headers={"X-Rollout-Class": "rlvr", "X-Session-Id": f"keep-{i}"}) as resp:
                assert resp.status == 200, await resp.text()
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue  # blank separators and the closing [DONE]
                    event = json.loads(line[len(b"data: "):])
                    choices = event.get("choices") or []
                    if choices:
                        generating.add(i)
                    reasons += [c["finish_reason"] for c in choices if c.get("finish_reason")]
                    if reasons:
                        finished.add(i)  # the engine is done with it
                    if len(generating - finished) >= 2:
                        two_generating.set()
                    if event.get("usage"):
                        usage = event["usage"]["completion_tokens"]
            finished.add(i)
            return reasons, usage

        tasks = [asyncio.create_task(stream(i)) for i in range(KEEP_STREAMS)]
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        try:
            # Paused the moment two streams are generating, on the client's own word: a stream that
            # has sent a chunk and not its end is running on its engine, so the reset must preempt
            # it. vLLM's running gauge is no gate: it is its last logged step's, and on a loaded
            # machine it read 2 after the streams had ended (CI paused with nothing in flight).
            try:
                await asyncio.wait_for(two_generating.wait(), 60.0)
            except TimeoutError:
                pytest.fail(f"two streams not generating: {await _status_brief(router)}", pytrace=False)
            generating_at_pause = generating - finished
            async with http.post(f"{router.url}/admin/pause", params={"mode": "keep", "reset_prefix_cache": "false"},
                                 headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                paused = await resp.json()
            frozen = paused["frozen_engines"]
            engines_paused = {}
            for url in vllm_base_urls:
                async with http.get(f"{url}/is_paused") as resp:
                    engines_paused[url] = (await resp.json())["is_paused"]
            async with http.post(f"{router.url}/admin/resume", params={"reset_prefix_cache": "true"},
                                 headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                resumed = await resp.json()
            async with asyncio.timeout(300):
                results = await asyncio.gather(*tasks)
        finally:
            await cancel_all(tasks)
        assert paused["mode"] == "keep" and paused["aborted_requests"] == 0
        assert paused["requests_in_flight"] >= len(generating_at_pause) >= 2, (paused, generating_at_pause)
        assert frozen and set(frozen) <= set(vllm_base_urls)
        assert all(engines_paused[u] for u in frozen), engines_paused  # vLLM's own word
        assert resumed["paused"] is False and resumed["frozen_engines"] == []
        assert resumed["prefix_cache_reset"] == dict.fromkeys(vllm_base_urls, "ok")
        for url in vllm_base_urls:
            async with http.get(f"{url}/is_paused") as resp:
                assert (await resp.json())["is_paused"] is False
        # Every stream ran to its end: nothing aborted, every token there.
        assert results == [(["length"], KEEP_OUTPUT)] * KEEP_STREAMS
        await wait_drained(router)
        assert await router.metric_sum("misat_requests_total", outcome="ok") == KEEP_STREAMS
        after = await engine_counters(http, vllm_base_urls)
        preempted = _delta(after, before, M_PREEMPTIONS)
        # The frozen requests stayed on their engines and the reset preempted them (vLLM's counts):
        # at least every stream that was generating at the pause. Over the frozen engines, not per
        # engine: a request sent just before the pause may wait unscheduled on an engine of its
        # own, frozen with nothing running to preempt.
        preempted_frozen = {u: after[u].get(M_PREEMPTIONS, 0.0) - before[u].get(M_PREEMPTIONS, 0.0) for u in frozen}
        assert sum(preempted_frozen.values()) >= len(generating_at_pause), (generating_at_pause, preempted_frozen)
        record_figure("in_flight_at_keep_pause", paused["requests_in_flight"])
        record_figure("frozen_engines", len(frozen))
        record_figure("generating_at_keep_pause", len(generating_at_pause))
        record_figure("preemptions_in_the_test", preempted)


# ----------------------------------------------------------------------------- engine killed (last)

KILL_STREAMS = 6
KILL_JSON = 6
KILL_SESSIONS = 2
KILL_TURNS = 3


@dataclass
class Outcomes:
    ok: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)

    def success(self, kind: str) -> None:
        self.ok[kind] = self.ok.get(kind, 0) + 1

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1


CLEAR_ERROR_TYPES = {"upstream_error", "service_unavailable_error"}


def _classify(exc: Exception, out: Outcomes) -> None:
    """A clear error is the router's OpenAI-shaped upstream/unavailable error; anything else is not."""
    import openai

    body = getattr(exc, "body", None)
    if isinstance(exc, openai.APIError) and isinstance(body, dict) and body.get("type") in CLEAR_ERROR_TYPES:
        out.error(str(body.get("code") or body.get("type")))
    elif isinstance(exc, openai.APIStatusError) and isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("type") in CLEAR_ERROR_TYPES:
            out.error(str(inner.get("code") or inner.get("type")))
        else:
            out.unexpected.append(f"{type(exc).__name__}: {exc}")
    else:
        out.unexpected.append(f"{type(exc).__name__}: {exc}")


@pytest.mark.e2e
@pytest.mark.e2e_last
async def test_engine_killed_mid_run_requests_end_cleanly_and_accounting_drains(
    vllm_servers: list[RunningServer], http: aiohttp.ClientSession, record_figure: Callable[[str, object], None]
) -> None:
    urls = [s.base_url for s in vllm_servers]
    async with running_router(router_config(urls)) as router:
        client = router.openai()
        out = Outcomes()

        async def stream(i: int) -> None:
            try:
                s = await client.completions.create(
                    model=MODEL, prompt=_ids(3000 + i, 100), max_tokens=600, temperature=0.0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                    extra_headers={"X-Rollout-Class": "rlvr", "X-Session-Id": f"kill-s{i}"},
                )  # fmt: skip
                usage = None
                async for chunk in s:
                    usage = chunk.usage or usage
                assert usage is not None and usage.completion_tokens == 600
                out.success("stream")
            except Exception as exc:
                _classify(exc, out)

        async def json_request(i: int) -> None:
            try:
                resp = await client.completions.create(
                    model=MODEL, prompt=_ids(4000 + i, 100), max_tokens=300, temperature=0.0,
                    extra_body={"ignore_eos": True}, extra_headers={"X-Rollout-Class": "rlhf"},
                )  # fmt: skip
                assert resp.usage.completion_tokens == 300
                out.success("json")
            except Exception as exc:
                _classify(exc, out)

        async def session(i: int) -> None:
            sid = f"kill-a{i}"
            prompt = _ids(5000 + i, 150)
            for turn in range(KILL_TURNS):
                headers = {"X-Rollout-Class": "agentic", "X-Session-Id": sid, "X-Session-Turn": str(turn)}
                if turn == KILL_TURNS - 1:
                    headers["X-Session-End"] = "1"
                try:
                    resp = await client.completions.create(
                        model=MODEL, prompt=prompt, max_tokens=40, temperature=0.0,
                        extra_body={"ignore_eos": True, "return_token_ids": True}, extra_headers=headers,
                    )  # fmt: skip
                except Exception as exc:
                    _classify(exc, out)
                    # A trainer abandoning a trajectory ends its session (200, or 404 if already gone).
                    async with http.post(f"{router.url}/v1/sessions/{sid}/end") as end:
                        assert end.status in (200, 404)
                    return
                out.success("turn")
                prompt = [*prompt, *resp.choices[0].model_extra["token_ids"], *_ids(6000 + 10 * i + turn, 50)]

        tasks = [asyncio.create_task(stream(i)) for i in range(KILL_STREAMS)]
        tasks += [asyncio.create_task(json_request(i)) for i in range(KILL_JSON)]
        tasks += [asyncio.create_task(session(i)) for i in range(KILL_SESSIONS)]
        try:
            at_kill: dict[str, Any] = {}

            async def both_busy() -> bool:
                nonlocal at_kill
                at_kill = await router.status()
                return all(e["in_flight"] >= 2 for e in at_kill["engines"])

            await poll_until(both_busy, 120.0, lambda: _status_brief(router))
            # Kill the engine with the most of the router's requests in flight, mid-run.
            victim_row = max(at_kill["engines"], key=lambda e: e["in_flight"])
            victim = next(s for s in vllm_servers if s.base_url == victim_row["id"])
            os.killpg(victim.pid, signal.SIGKILL)  # the API server and its engine-core child
            killed_at = time.monotonic()
            async with asyncio.timeout(400):
                await asyncio.gather(*tasks)
            victim.process.wait(timeout=30)
        finally:
            await cancel_all(tasks)
        survivor = next(u for u in urls if u != victim.base_url)

        total = KILL_STREAMS + KILL_JSON + KILL_SESSIONS * KILL_TURNS
        assert not out.unexpected, out.unexpected
        assert sum(out.ok.values()) + sum(out.errors.values()) <= total
        # Non-streamed answers had sent the client nothing yet: placed again on the survivor.
        assert out.ok.get("json", 0) == KILL_JSON, out
        # A stream either completes or, if it was live on the victim, ends with the router's
        # mid-stream error event (engine_stream_broken).
        assert out.ok.get("stream", 0) + out.errors.get("engine_stream_broken", 0) == KILL_STREAMS, out
        # The kill really cut requests: the router saw the victim's connections fail.
        assert await router.metric_sum("misat_engine_connection_failures_total", engine=victim.base_url) >= 1
        # The router took the victim out of rotation and drained everything it held.
        status = await wait_drained(router, healthy_engines=1)
        victim_row = next(e for e in status["engines"] if e["id"] == victim.base_url)
        assert victim_row["healthy"] is False and victim_row["in_flight"] == 0
        # The survivor keeps serving.
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt=_ids(7000, 50), max_tokens=4, extra_headers={"X-Rollout-Class": "rlvr"}
        )
        assert raw.headers["X-Misat-Engine"] == survivor
        await wait_drained(router, healthy_engines=1)
        record_figure("requests", total)
        record_figure("ok", out.ok)
        record_figure("errors", out.errors)
        record_figure("in_flight_at_kill", {e["id"]: e["in_flight"] for e in at_kill["engines"]})
        record_figure("victim", victim.base_url)
        record_figure("retried", await router.metric_sum("misat_requests_total", outcome="retried"))
        record_figure("drained_within_s_of_kill", round(time.monotonic() - killed_at, 1))
