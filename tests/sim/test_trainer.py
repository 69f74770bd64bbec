"""Trainer emulator against a stub OpenAI server (aiohttp on port 0), and the report maths."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
from aiohttp import web

from misat_sim.report import RunStats, Usage, tv_distance_points
from misat_sim.trainer import Hook, Trainer, TrainerConfig, parse_retry_after
from misat_sim.workload import RolloutClass, WorkloadSpec, plan_agentic

RLVR, RLHF, AGENTIC = RolloutClass.RLVR, RolloutClass.RLHF, RolloutClass.AGENTIC
VOCAB = 2048


@dataclass
class Stub:
    """A deterministic OpenAI completions server that logs what it saw.

    Output ids are a function of the prompt length; ``cached_tokens`` is the
    longest prefix shared with any earlier prompt + output (a toy prefix cache).
    """

    unavailable: int = 0  # answer this many requests with 503 + Retry-After first
    retry_after: str = "0.25"
    fail_status: int | None = None  # answer every request with this status
    omit_token_ids: bool = False
    log: list[tuple[str, Any]] = field(default_factory=list)  # ("req", record) / ("hook", path)
    usages: list[dict[str, Any]] = field(default_factory=list)
    seen: list[list[int]] = field(default_factory=list)
    base_url: str = ""

    def output_for(self, prompt: list[int], n: int) -> list[int]:
        return [3 + (len(prompt) * 31 + i) % (VOCAB - 3) for i in range(n)]

    def cached(self, prompt: list[int]) -> int:
        best = 0
        for seq in self.seen:
            n = 0
            for a, b in zip(prompt, seq, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.fail_status is not None:
            return web.json_response({"error": "boom"}, status=self.fail_status)
        if self.unavailable > 0:
            self.unavailable -= 1
            self.log.append(("503", dict(request.headers)))
            return web.Response(status=503, headers={"Retry-After": self.retry_after})
        prompt, n = body["prompt"], body["max_tokens"]
        output = self.output_for(prompt, n)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": n,
            "total_tokens": len(prompt) + n,
            "prompt_tokens_details": {"cached_tokens": self.cached(prompt)},
        }
        self.seen.append(prompt + output)
        self.usages.append(usage)
        self.log.append(("req", {"headers": dict(request.headers), "body": body, "out": output}))
        choice: dict[str, Any] = {"index": 0, "text": "", "finish_reason": "length"}
        if not self.omit_token_ids:
            choice["token_ids"] = output
        if not body.get("stream"):
            return web.json_response({"id": "c", "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        half = len(output) // 2
        for part in (output[:half], output[half:]):
            chunk = {"choices": [{**choice, "token_ids": part}]}
            if self.omit_token_ids:
                del chunk["choices"][0]["token_ids"]
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def hook(self, request: web.Request) -> web.Response:
        self.log.append(("hook", request.path))
        return web.Response(status=200)

    def requests(self) -> list[dict[str, Any]]:
        return [rec for kind, rec in self.log if kind == "req"]


@pytest.fixture
async def stub() -> AsyncIterator[Stub]:
    server = Stub()
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/reset_prefix_cache", server.hook)
    app.router.add_post("/admin/resume", server.hook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    server.base_url = f"http://127.0.0.1:{port}"
    yield server
    await runner.cleanup()


class RecordingSleep:
    """Injected sleep: records delays, yields control, never waits on the clock."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        await asyncio.sleep(0)


def only(klass: RolloutClass, **fields: Any) -> WorkloadSpec:
    return WorkloadSpec(mixture={klass: 100}, **fields)


def by_session(requests: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    sessions: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in requests:
        sessions[rec["headers"]["X-Session-Id"]].append(rec)
    return sessions


# --- agentic sessions --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_agentic_turns_carry_headers_and_real_output_ids(stub: Stub, stream: bool):
    spec = only(AGENTIC, seed=4)
    sleep = RecordingSleep()
    cfg = TrainerConfig(
        base_url=stub.base_url, max_units=3, max_in_flight=2, time_scale=10.0, stream=stream
    )
    report = await Trainer(cfg, spec, sleep=sleep).run()

    sessions = by_session(stub.requests())
    assert len(sessions) == 3
    expected_gaps = []
    for index in range(3):
        plan = plan_agentic(spec, index)
        recs = sessions[plan.session_id]
        assert [r["headers"]["X-Session-Turn"] for r in recs] == [
            str(t) for t in range(len(plan.turns))
        ]
        assert all(r["headers"]["X-Rollout-Class"] == "agentic" for r in recs)
        assert [r["headers"].get("X-Session-End") for r in recs] == [None] * (len(recs) - 1) + [
            "1"
        ]
        assert recs[0]["body"]["prompt"] == plan.initial_prompt()
        for t in range(1, len(recs)):
            prev, cur = recs[t - 1], recs[t]["body"]["prompt"]
            # The next prompt is the previous prompt + what the engine returned + tool tokens.
            assert cur == prev["body"]["prompt"] + prev["out"] + plan.appended_tokens(t)
        for r, turn in zip(recs, plan.turns, strict=True):
            body = r["body"]
            assert body["max_tokens"] == turn.max_tokens
            assert body["ignore_eos"] is True and body["return_token_ids"] is True
            assert body.get("stream", False) is stream
        expected_gaps += [t.tool_gap_s / 10.0 for t in plan.turns[:-1]]
    # Tool gaps are awaited, scaled by time_scale.
    assert sorted(sleep.calls) == pytest.approx(sorted(expected_gaps))
    assert report.units_completed == 3 and report.per_class[AGENTIC].units == 3
    assert report.missing_token_ids == 0 and report.errors == 0
    # The stub's toy cache hits the whole previous context on every continuation.
    assert report.prefix_hit_rate is not None and report.prefix_hit_rate > 0.5


async def test_missing_token_ids_fall_back_to_synthetic_ids(stub: Stub):
    stub.omit_token_ids = True
    spec = only(AGENTIC, seed=2)
    cfg = TrainerConfig(base_url=stub.base_url, max_units=1, time_scale=1000.0)
    report = await Trainer(cfg, spec, sleep=RecordingSleep()).run()
    plan = plan_agentic(spec, 0)
    recs = stub.requests()
    assert report.missing_token_ids == len(recs) == len(plan.turns)
    second = recs[1]["body"]["prompt"]
    first = recs[0]["body"]["prompt"]
    assert second[len(first) : len(first) + plan.turns[0].max_tokens] == plan.synthetic_output(
        0, plan.turns[0].max_tokens
    )


# --- single-request classes ----------------------------------------------------------------


async def test_grpo_samples_send_session_ids_and_share_prompts(stub: Stub):
    spec = WorkloadSpec(mixture={RLVR: 50, RLHF: 50}, length_scale=1 / 256)
    cfg = TrainerConfig(base_url=stub.base_url, max_units=48, max_in_flight=8)
    report = await Trainer(cfg, spec).run()
    recs = stub.requests()
    assert len(recs) == 48
    groups: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for rec in recs:
        h = rec["headers"]
        assert h["X-Rollout-Class"] in ("rlvr", "rlhf")
        assert h["X-Session-Turn"] == "0" and "X-Session-End" not in h
        groups[h["X-Session-Id"].rsplit("-s", 1)[0]].add(tuple(rec["body"]["prompt"]))
    assert all(len(prompts) == 1 for prompts in groups.values())
    assert len({rec["headers"]["X-Session-Id"] for rec in recs}) == 48
    assert report.per_class[RLVR].units == 32 and report.per_class[RLHF].units == 16


# --- retries and errors ------------------------------------------------------------------


async def test_503_with_retry_after_is_retried_after_that_delay(stub: Stub):
    stub.unavailable, stub.retry_after = 3, "0.25"
    sleep = RecordingSleep()
    cfg = TrainerConfig(base_url=stub.base_url, max_units=8, max_in_flight=8)
    report = await Trainer(cfg, only(RLHF, length_scale=1 / 256), sleep=sleep).run()
    assert report.retries == 3
    assert sleep.calls.count(0.25) == 3
    assert report.units_completed == 8 and report.errors == 0
    assert len(stub.requests()) == 8


async def test_retries_are_bounded_and_other_failures_are_errors(stub: Stub):
    stub.unavailable = 100
    cfg = TrainerConfig(base_url=stub.base_url, max_units=1, max_retries=2)
    report = await Trainer(cfg, only(RLHF, group_size={RLHF: 1}), sleep=RecordingSleep()).run()
    assert report.retries == 2
    assert report.errors_by_kind == {"http_503": 1}
    assert report.units_completed == 0 and report.units_in_flight == 0

    stub.unavailable, stub.fail_status = 0, 500
    report = await Trainer(cfg, only(RLHF, group_size={RLHF: 1})).run()
    assert report.errors_by_kind == {"http_500": 1} and report.units_completed == 0
    assert "boom" in report.error_examples["http_500"]


async def test_unreachable_engine_is_an_error_not_a_crash():
    cfg = TrainerConfig(base_url="http://127.0.0.1:9", max_units=2, request_timeout_s=5)
    report = await Trainer(cfg, only(RLHF, group_size={RLHF: 1})).run()
    assert report.errors == 2 and report.units_completed == 0


def test_parse_retry_after_forms():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert parse_retry_after("5", 1.0) == 5.0
    assert parse_retry_after("0.5", 1.0) == 0.5
    assert parse_retry_after(None, 1.0) == 1.0
    assert parse_retry_after("soon", 1.0) == 1.0
    assert parse_retry_after(format_datetime(now + timedelta(seconds=30)), 1.0, now) == 30.0
    assert parse_retry_after("-3", 1.0) == 0.0


# --- iterations and hooks ----------------------------------------------------------------


async def test_iteration_hooks_run_between_iterations_in_order(stub: Stub):
    hooks = (
        Hook(url=stub.base_url + "/reset_prefix_cache"),
        Hook(url=stub.base_url + "/admin/resume"),
    )
    cfg = TrainerConfig(
        base_url=stub.base_url, mode="iterations", iterations=3, batch_units=16,
        max_in_flight=4, hooks=hooks,
    )
    report = await Trainer(cfg, only(RLHF, length_scale=1 / 256)).run()
    kinds = [kind if kind == "req" else rec for kind, rec in stub.log]
    block = ["req"] * 16 + ["/reset_prefix_cache", "/admin/resume"]
    assert kinds == block * 3  # every request of an iteration before its hooks, then the next
    assert report.iterations == 3 and len(report.iteration_times_s) == 3
    assert report.mean_iteration_s == pytest.approx(sum(report.iteration_times_s) / 3)
    assert report.units_completed == 48


async def test_ceiling_bounds_units_in_flight(stub: Stub):
    gate, all_in_gap = asyncio.Event(), asyncio.Event()
    peak, entered = 0, 0
    trainer: Trainer

    async def held_gap(seconds: float) -> None:
        nonlocal peak, entered
        entered += 1
        peak = max(peak, trainer.snapshot().units_in_flight)
        if entered == 5:
            all_in_gap.set()
        await gate.wait()

    cfg = TrainerConfig(base_url=stub.base_url, max_units=12, max_in_flight=5)
    trainer = Trainer(cfg, only(AGENTIC), sleep=held_gap)
    run = asyncio.create_task(trainer.run())
    await asyncio.wait_for(all_in_gap.wait(), timeout=10)
    snap = trainer.snapshot()
    # Sessions in a tool gap keep their slot: nothing more is released.
    assert snap.units_in_flight == 5 and snap.units_released == 5
    assert len(by_session(stub.requests())) == 5
    gate.set()
    report = await run
    assert peak == 5 and report.units_completed == 12


async def test_duration_stops_and_cancels_unfinished_units(stub: Stub):
    never = asyncio.Event()

    async def endless_gap(seconds: float) -> None:
        await never.wait()

    cfg = TrainerConfig(base_url=stub.base_url, duration_s=0.3, max_in_flight=3)
    report = await Trainer(cfg, only(AGENTIC), sleep=endless_gap).run()
    assert report.units_released == 3
    assert report.units_completed == 0 and report.units_in_flight == 0
    assert report.elapsed_s >= 0.3


# --- report figures ----------------------------------------------------------------------


async def test_report_figures_come_from_the_engines_usage(stub: Stub):
    spec = WorkloadSpec(seed=8, length_scale=1 / 64)
    cfg = TrainerConfig(base_url=stub.base_url, max_units=40, max_in_flight=6, time_scale=1e6)
    report = await Trainer(cfg, spec).run()
    prompt = sum(u["prompt_tokens"] for u in stub.usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in stub.usages)
    completion = sum(u["completion_tokens"] for u in stub.usages)
    assert (report.prompt_tokens, report.cached_tokens, report.completion_tokens) == (
        prompt, cached, completion,
    )
    assert cached > 0 and report.prefix_hit_rate == pytest.approx(cached / prompt)
    assert report.requests == len(stub.usages)
    per_s = 1 / report.elapsed_s
    assert report.decode_tokens_per_s == pytest.approx(completion * per_s)
    assert report.prefill_tokens_per_s == pytest.approx(prompt * per_s)
    assert report.uncached_prefill_tokens_per_s == pytest.approx((prompt - cached) * per_s)
    assert report.units_completed == report.units_released >= 40
    assert report.sample_rate_per_min == pytest.approx(report.units_completed * 60 * per_s)
    assert report.requests_per_min == pytest.approx(report.requests * 60 * per_s)
    assert sum(p.units for p in report.throughput_series) == report.units_completed
    counts = {k: f.units for k, f in report.per_class.items()}
    total = sum(counts.values())
    assert report.consumed_mixture_pct == {k: 100 * v / total for k, v in counts.items()}
    assert report.target_mixture_pct[AGENTIC] == pytest.approx(100 * 48.6 / 99.9)
    assert report.mixture_tv_points == pytest.approx(
        tv_distance_points(report.target_mixture_pct, report.consumed_mixture_pct)
    )
    json.loads(report.model_dump_json())  # JSON-serialisable


def test_tv_distance_in_points():
    assert tv_distance_points({"a": 50, "b": 50}, {"a": 100}) == pytest.approx(50.0)
    assert tv_distance_points({"a": 1, "b": 3}, {"a": 25, "b": 75}) == pytest.approx(0.0)
    # The paper's end-to-end figures: target 48.6/33.1/18.2, consumed 45.9/33.3/20.8.
    paper = tv_distance_points({"g": 48.6, "v": 33.1, "h": 18.2}, {"g": 45.9, "v": 33.3, "h": 20.8})
    assert paper == pytest.approx(2.75, abs=0.01)  # the paper rounds its inputs; it says 2.71


def test_run_stats_series_rates_and_phase_averaged_target():
    stats = RunStats(start=100.0, bucket_s=10.0)
    stats.on_released({RLVR: 1.0, RLHF: 0.0, AGENTIC: 0.0})
    stats.on_released({RLVR: 0.0, RLHF: 1.0, AGENTIC: 0.0})
    stats.on_request(RLVR, Usage(prompt_tokens=100, completion_tokens=50, cached_tokens=40))
    stats.on_unit_done(RLVR, now=105.0)
    stats.on_unit_done(RLHF, now=125.0, ok=False)
    report = stats.report(now=130.0)
    assert report.target_mixture_pct == {RLVR: 50.0, RLHF: 50.0, AGENTIC: 0.0}
    assert report.consumed_mixture_pct == {RLVR: 100.0, RLHF: 0.0, AGENTIC: 0.0}
    assert report.mixture_tv_points == pytest.approx(50.0)
    assert [(p.t_s, p.units) for p in report.throughput_series] == [
        (0.0, 1), (10.0, 0), (20.0, 0), (30.0, 0),
    ]
    assert report.sample_rate_per_min == pytest.approx(2.0)  # 1 unit in 30 s
    assert report.prefix_hit_rate == pytest.approx(0.4)
    assert report.units_in_flight == 0 and report.units_completed == 1


# --- against the project's simulated vLLM engine ------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_trainer_against_the_simulated_engine(stream: bool):
    server_mod = pytest.importorskip("misat_sim.server")
    from misat_sim.config import SimEngineConfig

    engine_cfg = SimEngineConfig(time_scale=2000.0)
    server = await server_mod.start_server(engine_cfg)
    try:
        spec = WorkloadSpec(seed=6, length_scale=1 / 128)
        cfg = TrainerConfig(
            base_url=server.base_url, model=engine_cfg.model_name(), max_units=20,
            max_in_flight=8, time_scale=engine_cfg.time_scale, stream=stream,
        )
        report = await Trainer(cfg, spec).run()
    finally:
        await server.stop()
    assert report.errors_by_kind == {} and report.missing_token_ids == 0
    assert report.units_completed == report.units_released >= 20
    agentic = report.per_class[AGENTIC]
    assert agentic.units > 0 and agentic.requests > agentic.units  # multi-turn
    # Continuations resend the engine's own output ids, so its prefix cache hits them.
    assert agentic.cached_tokens > 0.5 * agentic.prompt_tokens
