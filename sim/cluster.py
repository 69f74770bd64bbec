"""A discrete-event cluster: simulated engines + a router policy + a trainer, in virtual time.

The same ``PolicyRunner`` the live router uses decides every request; the
engines are ``SimEngine`` models; the trainer releases rollout units from a
``Workload`` to keep at most ``ceiling`` units in flight (the trainer's
concurrency ceiling, the "static concurrency" the paper swept), and, in
iteration mode, releases a batch, waits for all of it, resets every prefix
cache (a weight update) and starts the next.

Time moves in slices: engines run to the next external event (an arrival
after a tool gap, a scrape, an admission epoch) but never more than
``reaction_slice_s`` ahead, so the router reacts to a completion at most one
slice late, about one engine step, as a real router's round trip would.

Use it for sweeps and for choosing policy defaults; the HTTP stack (router
service, simulator server, real vLLM Router) is measured separately.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from misat_router.policy.registry import build_policy
from misat_router.policy.runner import PolicyRunner
from misat_router.policy.settings import ClassSpec, PolicySettings, WorkloadMix
from misat_router.policy.types import Completion, EngineSnapshot, RequestMeta
from misat_sim.config import SimEngineConfig
from misat_sim.engine import FinishedRequest, SimEngine
from misat_sim.metrics import read_metrics
from misat_sim.workload import RolloutClass, SessionPlan, Workload, WorkloadSpec


class ClusterConfig(BaseModel):
    """One cluster run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engines: int = Field(4, ge=1, description="Engine replicas.")
    engine: SimEngineConfig = SimEngineConfig()
    policy: PolicySettings = PolicySettings()
    workload: WorkloadSpec = WorkloadSpec()
    ceiling: int = Field(256, ge=1, description="Trainer's max rollout units in flight.")
    duration_s: float = Field(1800.0, gt=0, description="Virtual seconds to run (continuous mode).")
    warmup_s: float = Field(300.0, ge=0, description="Virtual seconds excluded from rates.")
    iterations: int = Field(0, ge=0, description="0: continuous; else batches with weight updates.")
    iteration_units: int = Field(512, ge=1, description="Units per iteration.")
    scrape_interval_s: float = Field(0.5, gt=0, description="Engine /metrics scrape period.")
    reaction_slice_s: float = Field(0.05, gt=0, description="Longest engine run between router looks.")
    engine_kv_overrides: tuple[int | None, ...] = Field(
        (), description="Per-engine num_gpu_blocks (heterogeneous pools); empty: all alike."
    )
    block_size: int | None = Field(
        None, gt=0,
        description="Tokens per KV block, for the engines and the router's prefix index alike (the "
        "simulation's granularity; None: the engine profile's). Independent of the length scale: "
        "full-length sequences with 256-token blocks keep the block count of 1/16-length ones with 16.",
    )

    @model_validator(mode="after")
    def _one_block_size(self) -> ClusterConfig:
        if self.block_size is None:
            engine_bs = self.engine.resolve().block_size
            if self.policy.prefix.block_size != engine_bs:
                raise ValueError(
                    f"policy.prefix.block_size {self.policy.prefix.block_size} differs from the engines' "
                    f"block size {engine_bs}: the router would index blocks the engines do not have; "
                    "set block_size to set both"
                )
        return self

    def with_granularity(self) -> ClusterConfig:
        """This config with ``block_size`` applied to the engine and the prefix index."""
        if self.block_size is None:
            return self
        engine = self.engine.model_copy(update={"block_size": self.block_size})
        prefix = self.policy.prefix.model_copy(update={"block_size": self.block_size})
        policy = self.policy.model_copy(update={"prefix": prefix})
        return self.model_copy(update={"engine": engine, "policy": policy})


@dataclass(slots=True)
class _Unit:
    plan: SessionPlan
    turn: int = 0
    prompt: tuple[int, ...] = ()
    released_at: float = 0.0
    prompt_block_hashes: list[int] = field(default_factory=list)
    """Engine block hashes of the prompt's leading blocks, from the previous turn (saves rehashing)."""


@dataclass
class ClusterResult:
    """Figures of one run (rates over the measured window, after warm-up)."""

    units_completed: dict[str, int]
    sample_rate_per_min: float
    requests_per_min: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    prefix_hit_rate: float
    tv_points: float
    preemptions: int
    mean_kv_usage: float
    mean_iteration_s: float | None
    measured_s: float
    series: list[tuple[float, int]]
    held_peak: int

    def as_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def mix_for(spec: WorkloadSpec, bootstrap_tokens: int = PolicySettings().footprint.bootstrap_tokens) -> WorkloadMix:
    """The router's workload classes for a workload spec (agentic is multi-turn).

    The footprint prior is in real tokens; the workload's lengths are scaled, so
    the prior is scaled alike.
    """
    prior = max(1, round(bootstrap_tokens * spec.length_scale))
    target = spec.mixture_at(0.0)
    shares = {c: round(100.0 * target[c], 6) for c in RolloutClass}
    # Make the shares sum to exactly 100 whatever the rounding did.
    first = next(iter(shares))
    shares[first] = round(100.0 - sum(v for c, v in shares.items() if c != first), 6)
    return WorkloadMix(
        classes=tuple(
            ClassSpec(name=c.value, share=shares[c], multi_turn=c is RolloutClass.AGENTIC,
                      bootstrap_footprint_tokens=prior)
            for c in RolloutClass
        )
    )


class Cluster:
    """One run; ``run()`` returns a ``ClusterResult``."""

    def __init__(self, cfg: ClusterConfig, on_progress: Callable[[Cluster], None] | None = None) -> None:
        cfg = cfg.with_granularity()
        self.cfg = cfg
        self.mix = mix_for(cfg.workload, cfg.policy.footprint.bootstrap_tokens)
        self.runner = PolicyRunner(build_policy(cfg.policy, self.mix), self.mix)
        self.engines: dict[str, SimEngine] = {}
        for i in range(cfg.engines):
            override = cfg.engine_kv_overrides[i] if i < len(cfg.engine_kv_overrides) else None
            ecfg = cfg.engine.model_copy(update={"seed": cfg.engine.seed + i, "engine_index": i,
                                                 **({"num_gpu_blocks": override} if override else {})})
            self.engines[f"engine-{i}"] = SimEngine(ecfg)
        self.workload = Workload(cfg.workload)
        self.on_progress = on_progress
        self.now = 0.0
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._units: dict[str, _Unit] = {}
        self._requests: dict[str, tuple[RequestMeta, _Unit]] = {}
        self._req_ids = itertools.count()
        self.in_flight_units = 0
        self.completed: list[tuple[float, str]] = []
        self._stats = {"requests": 0, "prompt": 0, "cached": 0, "decode": 0, "kv_samples": 0.0, "kv_n": 0}
        self._iteration_left = 0
        self._iteration_started = 0.0
        self.iteration_times: list[float] = []
        self.iterations_done = 0
        self.held_peak = 0
        self.snapshots: dict[str, EngineSnapshot] = {}

    # ---- events ---------------------------------------------------------

    def _push(self, t: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def _snapshot(self, engine_id: str, eng: SimEngine) -> EngineSnapshot:
        return EngineSnapshot.from_metrics(engine_id, read_metrics(eng), healthy=True, scraped_at=self.now)

    def _scrape(self) -> None:
        self.snapshots = {e: self._snapshot(e, eng) for e, eng in self.engines.items()}
        self.runner.on_metrics(self.snapshots, self.now)
        if self.now >= self.cfg.warmup_s:
            for snap in self.snapshots.values():
                self._stats["kv_samples"] += snap.kv_usage
                self._stats["kv_n"] += 1

    # ---- trainer --------------------------------------------------------

    def _release_units(self) -> None:
        cfg = self.cfg
        while self.in_flight_units < cfg.ceiling:
            if cfg.iterations and self._iteration_left <= 0:
                return
            plans = self.workload.draw()
            for plan in plans:
                unit = _Unit(plan, 0, tuple(plan.initial_prompt()), self.now)
                self._units[plan.session_id] = unit
                self.in_flight_units += 1
                if cfg.iterations:
                    self._iteration_left -= 1
                self._submit(unit)

    def _submit(self, unit: _Unit) -> None:
        plan, turn = unit.plan, unit.turn
        multi = plan.klass is RolloutClass.AGENTIC
        req = RequestMeta(
            request_id=f"req-{next(self._req_ids)}",
            workload_class=plan.klass.value,
            session_id=plan.session_id,
            turn=turn,
            prompt_token_ids=unit.prompt,
            prompt_tokens=len(unit.prompt),
            max_tokens=plan.turns[turn].max_tokens,
            end_of_session=multi and turn == plan.last_turn,
        )
        self._requests[req.request_id] = (req, unit)
        decision = self.runner.submit(req, self.snapshots, self.now)
        if decision.placed:
            self._dispatch(req, decision.engine_id)  # type: ignore[arg-type]
        self.held_peak = max(self.held_peak, self.runner.held_count())

    def _dispatch(self, req: RequestMeta, engine_id: str) -> None:
        eng = self.engines[engine_id]
        limit = eng.limits.max_model_len - len(req.prompt_token_ids or ())
        max_tokens = max(1, min(req.max_tokens or 1, limit))
        unit = self._requests[req.request_id][1]
        eng.add_request(req.request_id, req.prompt_token_ids or (0,), max_tokens, ignore_eos=True,
                        arrival_time=self.now, prefix_block_hashes=unit.prompt_block_hashes,
                        discard_output_ids=unit.turn == unit.plan.last_turn)
        self._placed_on[req.request_id] = engine_id

    def _on_finished(self, engine_id: str, fin: FinishedRequest) -> None:
        req, unit = self._requests.pop(fin.request_id)
        self._placed_on.pop(fin.request_id, None)
        completion = Completion(fin.num_prompt_tokens, fin.num_output_tokens, fin.num_cached_tokens)
        self.runner.finish(req, engine_id, completion, self.now)
        if self.now >= self.cfg.warmup_s:
            s = self._stats
            s["requests"] += 1
            s["prompt"] += fin.num_prompt_tokens
            s["cached"] += fin.num_cached_tokens
            s["decode"] += fin.num_output_tokens
        plan = unit.plan
        if unit.turn < plan.last_turn:
            gap = plan.turns[unit.turn].tool_gap_s
            # plan.next_prompt's tokens as a tuple (RequestMeta and the engine keep it): the context
            # is copied once, by the tuple concatenation; unpacking it all would copy it into a list
            # and again into the tuple (speed: agentic contexts are re-sent every turn).
            tail = (*fin.output_token_ids, *plan.appended_tokens(unit.turn + 1))
            unit.prompt = unit.prompt + tail
            unit.prompt_block_hashes = fin.block_hashes  # every engine of the cluster has one block size
            unit.turn += 1
            if len(unit.prompt) >= self.engines[engine_id].limits.max_model_len:
                self._unit_done(unit)  # context full: the trajectory ends here, as a real one would
            else:
                self._push(self.now + gap, "turn", unit)
            return
        self._unit_done(unit)

    def _unit_done(self, unit: _Unit) -> None:
        plan = unit.plan
        if plan.klass is RolloutClass.AGENTIC:
            self.runner.end_session(plan.session_id, self.now)
        self._units.pop(plan.session_id, None)
        self.in_flight_units -= 1
        self.completed.append((self.now, plan.klass.value))
        if self.cfg.iterations and self._iteration_left <= 0 and self.in_flight_units == 0:
            self._end_iteration()
        self._release_units()

    def _end_iteration(self) -> None:
        self.iteration_times.append(self.now - self._iteration_started)
        self.iterations_done += 1
        for eng in self.engines.values():
            eng.reset_prefix_cache()
        self.runner.reset_prefix_caches(self.now)
        if self.iterations_done < self.cfg.iterations:
            self._start_iteration()

    def _start_iteration(self) -> None:
        self._iteration_started = self.now
        self._iteration_left = self.cfg.iteration_units

    # ---- main loop ------------------------------------------------------

    def _done(self) -> bool:
        if self.cfg.iterations:
            return self.iterations_done >= self.cfg.iterations
        return self.now >= self.cfg.duration_s

    def run(self) -> ClusterResult:
        cfg = self.cfg
        self._placed_on: dict[str, str] = {}
        self._scrape()
        epoch = cfg.policy.admission.epoch_s
        self._push(cfg.scrape_interval_s, "scrape")
        self._push(epoch, "epoch")
        if cfg.iterations:
            self._start_iteration()
        self._release_units()
        progress_every = 60.0
        next_progress = progress_every
        while not self._done():
            t_next = self._events[0][0] if self._events else math.inf
            until = min(t_next, self.now + cfg.reaction_slice_s)
            if not cfg.iterations:
                until = min(until, cfg.duration_s)
            finished: list[tuple[float, str, FinishedRequest]] = []
            for engine_id, eng in self.engines.items():
                # An engine whose step in flight ends at or past ``until`` has nothing to run
                # before it (advance would return an empty result): on a large fleet most
                # engines are mid-step at most of the cluster's events.
                if eng.clock < until and eng.has_unfinished_requests():
                    res = eng.advance(self.now, until, count_tokens=False)
                    finished.extend((f.finish_time, engine_id, f) for f in res.finished)
            for item in finished:
                self._push(item[0], "finish", (item[1], item[2]))
            self.now = until
            while self._events and self._events[0][0] <= self.now:
                _, _, kind, payload = heapq.heappop(self._events)
                self._handle(kind, payload)
            if self.on_progress is not None and self.now >= next_progress:
                next_progress += progress_every
                self.on_progress(self)
            if (cfg.iterations and not self._events and self.in_flight_units == 0
                    and not any(e.has_unfinished_requests() for e in self.engines.values())):
                break  # nothing left to do (defensive: an iteration ended without work)
        return self.result()

    def _handle(self, kind: str, payload: object) -> None:
        if kind == "finish":
            engine_id, fin = cast(tuple[str, FinishedRequest], payload)
            self._on_finished(engine_id, fin)
            self._release_held()
        elif kind == "turn":
            self._submit(payload)  # type: ignore[arg-type]
        elif kind == "scrape":
            self._scrape()
            self._push(self.now + self.cfg.scrape_interval_s, "scrape")
        elif kind == "epoch":
            for req, d in self.runner.epoch(self.snapshots, self.now):
                self._dispatch(req, d.engine_id)  # type: ignore[arg-type]
            self._push(self.now + self.cfg.policy.admission.epoch_s, "epoch")

    def _release_held(self) -> None:
        if self.runner.held_count():
            for req, d in self.runner.release(self.snapshots, self.now):
                self._dispatch(req, d.engine_id)  # type: ignore[arg-type]

    def result(self) -> ClusterResult:
        cfg = self.cfg
        start = 0.0 if cfg.iterations else cfg.warmup_s
        end = self.now
        measured = max(1e-9, end - start)
        window = [c for t, c in self.completed if t >= start]
        per_class = {c.value: 0 for c in RolloutClass}
        for c in window:
            per_class[c] += 1
        total = sum(per_class.values())
        target = self.cfg.workload.mixture_at(0.0)
        tv = (
            50.0 * sum(abs(per_class[c.value] / total - target[c]) for c in RolloutClass) if total else 0.0
        )
        s = self._stats
        bucket = 60.0
        series: dict[int, int] = {}
        for t, _ in self.completed:
            series[int(t // bucket)] = series.get(int(t // bucket), 0) + 1
        preemptions = sum(e.sync_counters().num_preemptions for e in self.engines.values())
        return ClusterResult(
            units_completed=per_class,
            sample_rate_per_min=60.0 * total / measured,
            requests_per_min=60.0 * s["requests"] / measured,
            prefill_tokens_per_s=(s["prompt"] - s["cached"]) / measured,
            decode_tokens_per_s=s["decode"] / measured,
            prefix_hit_rate=(s["cached"] / s["prompt"]) if s["prompt"] else 0.0,
            tv_points=tv,
            preemptions=preemptions,
            mean_kv_usage=(s["kv_samples"] / s["kv_n"]) if s["kv_n"] else 0.0,
            mean_iteration_s=(sum(self.iteration_times) / len(self.iteration_times))
            if self.iteration_times else None,
            measured_s=measured,
            series=sorted((k * bucket, v) for k, v in series.items()),
            held_peak=self.held_peak,
        )


def run_cluster(cfg: ClusterConfig, on_progress: Callable[[Cluster], None] | None = None) -> ClusterResult:
    """Run one configuration to completion."""
    return Cluster(cfg, on_progress).run()
