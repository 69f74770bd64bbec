"""Virtual-time model of one vLLM V1 engine: requests in, steps out.

Pure and synchronous: no asyncio, no wall clock. Time is passed in (``now``)
and each step returns its modelled duration, so the same object runs inside
the HTTP server (stepping in scaled real time) and inside an in-process
discrete-event cluster (stepping in virtual time).

- ``add_request`` / ``abort_request`` edit the queues (an abort frees blocks).
- ``step(now)`` runs one vLLM step starting at ``max(now, clock)``.
- ``advance(now, until)`` runs steps while they start before ``until`` (the
  caller's next external event), applying runs of identical decode steps at
  once (``Scheduler.run_decode_steps``): the per-step result is the same as
  stepping one by one, the cost is per event instead of per step. Within a
  step, too, the cost is per event: requests in steady decode are lazy (see
  ``misat_sim.scheduler``).
- ``counters`` holds what ``/metrics`` exports; finished requests carry their
  timestamps for the latency histograms.

Token ids of a request's output are seeded by (engine seed, prompt, sample
index): the sample index is the request's ``sample_seed`` if given, 0 for
greedy requests (``temperature == 0``, identical prompts give identical
outputs), else how many earlier requests of this engine had the same prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from misat_sim.config import EngineLimits, SimEngineConfig
from misat_sim.kv_cache import block_hashes_for
from misat_sim.request import FinishReason, SimRequest
from misat_sim.scheduler import ScheduleOutput, Scheduler

PROMPT_MEMORY: int = 1 << 16
"""Distinct recent prompts whose repeat count the engine remembers for sampling seeds."""


@dataclass(slots=True)
class FinishedRequest:
    """A request that left the engine, with what a client and the metrics need."""

    request_id: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    output_token_ids: list[int]
    """The generated ids; empty when the request was added with ``discard_output_ids``."""
    num_output_tokens: int
    """Generated tokens (the length of ``output_token_ids`` unless those were discarded)."""
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    num_preemptions: int
    block_hashes: list[int] = field(default_factory=list)
    """Chained hashes of the leading full blocks of prompt + output that the engine computed:
    a caller sending prompt + output (+ more) back as the next turn may pass them to
    ``add_request`` so they are not computed again."""


@dataclass(slots=True)
class StepResult:
    """What one call to ``step`` / ``advance`` did."""

    start: float
    duration: float = 0.0
    num_steps: int = 0
    first_tokens: list[str] = field(default_factory=list)
    """Requests that emitted their first token."""
    finished: list[FinishedRequest] = field(default_factory=list)
    num_preempted: int = 0
    _tokens: dict[str, int] = field(default_factory=dict)
    _lazy: list[tuple[SimRequest, int]] | None = None
    _counted: bool = True
    _g0: int = 0
    _g1: int = 0

    @property
    def end(self) -> float:
        """Modelled time at which the last step ended."""
        return self.start + self.duration

    @property
    def new_tokens(self) -> dict[str, int]:
        """Tokens emitted per request id (requests whose prefill is still partial are absent).

        Built on first access: requests in lazy decode emitted one token per
        step since they became lazy or since the call began, and counting that
        per request on every call would make a step cost per running request.
        Raises if the call was made with ``count_tokens=False``.
        """
        if not self._counted:
            raise RuntimeError("this result was produced with count_tokens=False: it has no new_tokens")
        lazy = self._lazy
        if lazy is not None:
            self._lazy = None
            nt = self._tokens
            g0, g1 = self._g0, self._g1
            for req, bg in lazy:
                k = g1 - (bg if bg > g0 else g0)
                if k > 0:
                    rid = req.request_id
                    nt[rid] = nt.get(rid, 0) + k
        return self._tokens


@dataclass(slots=True)
class EngineCounters:
    """Cumulative counters exported as vLLM metrics."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    request_success: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in FinishReason})
    num_steps: int = 0
    busy_time: float = 0.0


def _prompt_block_hashes(prompt: Sequence[int], block_size: int, known: Sequence[int]) -> list[int]:
    """Hashes of the prompt's full blocks, reusing ``known`` ones for its leading blocks."""
    n_full = len(prompt) // block_size
    reused = list(known[:n_full])
    if not reused:  # nothing known, or a prompt shorter than one block
        return block_hashes_for(prompt, block_size)
    reused += block_hashes_for(prompt, block_size, start_block=len(reused), parent_hash=reused[-1])
    return reused


class SimEngine:
    """One simulated vLLM engine (see module docstring)."""

    def __init__(self, limits: EngineLimits | SimEngineConfig) -> None:
        if isinstance(limits, SimEngineConfig):
            limits = limits.resolve()
        self.limits = limits
        self.step_time = limits.step_time
        self.scheduler = Scheduler(limits)
        self.requests: dict[str, SimRequest] = {}
        self.clock = 0.0
        self.counters = EngineCounters()
        # Insertion-ordered and bounded: a long-running server sees endless distinct prompts,
        # and only recent repeats (the samples of one GRPO group) need distinct seeds.
        self._prompt_occurrences: dict[int, int] = {}

    # --- requests -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        ignore_eos: bool = False,
        arrival_time: float,
        sample_seed: int | None = None,
        greedy: bool = False,
        prefix_block_hashes: Sequence[int] = (),
        discard_output_ids: bool = False,
    ) -> None:
        """Queue a request. Lengths must already be validated against ``max_model_len``.

        ``prefix_block_hashes``: chained hashes of the prompt's leading full blocks,
        as an earlier ``FinishedRequest.block_hashes`` of this engine's block size
        gives them for a prompt that starts with that request's prompt + output
        (a multi-turn session). The caller vouches for them; only the blocks after
        them are hashed here.

        ``discard_output_ids``: the caller will never read the output ids (the in-process
        cluster, for a session's last turn), so they are not drawn (speed only: every count,
        time, hit and eviction is as without it; ``misat_sim.request``).
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if not prompt_token_ids:
            raise ValueError("prompt must have at least one token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        limits = self.limits
        prompt = tuple(prompt_token_ids)  # no copy when it is a tuple already
        prompt_hash = hash(prompt)
        if sample_seed is None:
            if greedy:
                sample_seed = 0
            else:
                occurrences = self._prompt_occurrences
                sample_seed = occurrences.pop(prompt_hash, 0)
                occurrences[prompt_hash] = sample_seed + 1
                if len(occurrences) > PROMPT_MEMORY:
                    del occurrences[next(iter(occurrences))]
        req = SimRequest(
            request_id,
            prompt,
            max_tokens,
            ignore_eos=ignore_eos,
            arrival_time=arrival_time,
            block_size=limits.block_size,
            vocab_size=limits.vocab_size,
            eos_token_id=limits.eos_token_id,
            token_seed=hash((limits.seed, prompt_hash, sample_seed)),
            prompt_block_hashes=(
                _prompt_block_hashes(prompt, limits.block_size, prefix_block_hashes)
                if limits.enable_prefix_caching else []
            ),
            discard_output_ids=discard_output_ids,
        )
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str, now: float | None = None) -> bool:
        """Remove a request and free its blocks; False if it is not in the engine."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        req.finish_reason = FinishReason.ABORT
        req.finish_time = self.clock if now is None else now
        self.counters.request_success[FinishReason.ABORT.value] += 1
        return True

    def get_request(self, request_id: str) -> SimRequest | None:
        """The live request with this id, if any."""
        return self.requests.get(request_id)

    def output_token_ids(self, request_id: str) -> list[int]:
        """Output ids emitted so far by a live request (materialised on demand)."""
        req = self.requests[request_id]
        return list(req.materialize_outputs())

    # --- state ---------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests in the running list (``vllm:num_requests_running``)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting, preempted ones included (``vllm:num_requests_waiting``)."""
        return len(self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        """Whether a step would do anything."""
        return bool(self.scheduler.running or self.scheduler.waiting)

    def kv_cache_usage(self) -> float:
        """Share of KV blocks in use, 0..1 (``vllm:kv_cache_usage_perc``)."""
        return self.scheduler.pool.usage()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop all cached blocks; False while any block is in use (vLLM's rule). With
        ``reset_running_requests`` every running request is preempted first (counted as a
        preemption, as vLLM does), so their blocks are free and the reset goes through."""
        if reset_running_requests:
            self.counters.num_preemptions += self.scheduler.preempt_running()
        return self.scheduler.pool.reset_prefix_cache()

    # --- time ----------------------------------------------------------------

    def step(self, now: float) -> StepResult:
        """Run one step starting at ``max(now, clock)``; an idle engine returns a 0-step result."""
        start = now if now > self.clock else self.clock
        result = self._begin(start)
        self._one_step(start, result)
        return self._seal(result)

    def advance(self, now: float, until: float, *, count_tokens: bool = True) -> StepResult:
        """Run every step that starts before ``until`` (while there is work).

        Use it to move an engine to its caller's next event; the engine's
        ``clock`` ends at the end of the last step run (possibly past ``until``).
        ``count_tokens=False``: the caller never reads ``new_tokens`` (the in-process
        cluster), so the lazy requests are not listed for it (speed only).
        """
        start = now if now > self.clock else self.clock
        result = self._begin(start)
        sched = self.scheduler
        t = start
        while t < until and (sched.running or sched.waiting):
            out = self._one_step(t, result)
            t = self.clock
            if out is not None and t < until and sched.can_run_decode_steps(out):
                self._decode_run(t, until, result)
                t = self.clock
        return self._seal(result, count_tokens)

    def _begin(self, start: float) -> StepResult:
        sched = self.scheduler
        sched.call_g0 = sched.clock.g
        sched.call_tokens = {}
        return StepResult(start=start)

    def _seal(self, result: StepResult, count_tokens: bool = True) -> StepResult:
        """Attach what ``StepResult.new_tokens`` needs (explicit counts, lazy bases)."""
        sched = self.scheduler
        result._tokens = sched.call_tokens
        sched.call_tokens = {}
        if not count_tokens:
            result._counted = False
            return result
        result._g0 = sched.call_g0
        result._g1 = sched.clock.g
        if result._g1 > result._g0 and sched.num_lazy:
            result._lazy = sched.lazy_snapshot()
        return result

    def _one_step(self, start: float, result: StepResult) -> ScheduleOutput | None:
        sched = self.scheduler
        if not (sched.running or sched.waiting):
            self.clock = max(self.clock, start)
            return None
        preempted_before = sched.num_preemptions
        out = sched.schedule()
        duration = self.step_time.step_duration(
            out.prefill_tokens, out.decoding_seqs, out.kv_tokens_read, out.prefill_attn_pairs
        )
        end = start + duration
        for req in out.admitted:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = start
        produced, finished = sched.update_after_step(out)
        counters = self.counters
        new_tokens = sched.call_tokens
        for req in produced:
            rid = req.request_id
            new_tokens[rid] = new_tokens.get(rid, 0) + 1
            if req.first_token_time is None:
                req.first_token_time = end
                counters.prompt_tokens += req.num_prompt_tokens
                result.first_tokens.append(rid)
        counters.generation_tokens += len(produced) + out.lazy_seqs
        preempted = sched.num_preemptions - preempted_before
        if preempted:
            counters.num_preemptions += preempted
            result.num_preempted += preempted
        if finished:
            self._collect_finished(finished, end, result)
        counters.num_steps += 1
        counters.busy_time += duration
        result.num_steps += 1
        result.duration = end - result.start
        self.clock = end
        return out

    def _decode_run(self, start: float, until: float, result: StepResult) -> None:
        sched = self.scheduler
        n_seqs = sched.num_lazy
        k = sched.steps_to_next_finish()
        kv_read0 = sched.lazy_kv_read()
        step_time = self.step_time
        k = step_time.decode_steps_starting_before(until - start, n_seqs, kv_read0, k)
        if k < 1:
            return
        k, finished = sched.run_decode_steps(k)
        if k < 1:
            return
        duration = step_time.decode_run_duration(k, n_seqs, kv_read0)
        end = start + duration
        counters = self.counters
        counters.generation_tokens += k * n_seqs
        counters.num_steps += k
        counters.busy_time += duration
        if finished:
            self._collect_finished(finished, end, result)
        result.num_steps += k
        result.duration = end - result.start
        self.clock = end

    def _collect_finished(self, finished: list[SimRequest], end: float, result: StepResult) -> None:
        if not finished:
            return
        counters = self.counters
        for req in finished:
            req.finish_time = end
            reason = req.finish_reason or FinishReason.LENGTH
            counters.request_success[reason.value] += 1
            del self.requests[req.request_id]
            result.finished.append(
                FinishedRequest(
                    request_id=req.request_id,
                    finish_reason=reason,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    output_token_ids=[] if req.outputs_discarded else req.materialize_outputs(),
                    num_output_tokens=req.num_output_tokens,
                    arrival_time=req.arrival_time,
                    first_scheduled_time=req.first_scheduled_time,
                    first_token_time=req.first_token_time,
                    finish_time=end,
                    num_preemptions=req.num_preemptions,
                    block_hashes=req.known_block_hashes(),
                )
            )

    # --- counters that live in the scheduler ----------------------------------

    def sync_counters(self) -> EngineCounters:
        """Counters with the scheduler's prefix-cache totals folded in."""
        pc = self.scheduler.prefix_cache
        self.counters.prefix_cache_queries = pc.queries
        self.counters.prefix_cache_hits = pc.hits
        return self.counters
