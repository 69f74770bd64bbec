"""vLLM V1's scheduling step, over ``SimRequest`` objects and a ``KVCacheManager``.

It follows ``vllm/v1/core/sched/scheduler.py`` (``Scheduler.schedule``,
FCFS policy) where admission depends on it:

1. Running requests first, in running order, while the token budget
   (``max_num_batched_tokens``) lasts: each gets the tokens it lacks (1 for a
   decode, a chunk of its prompt for a prefill: chunked prefill), capped by
   the budget and by ``max_model_len - 1``. When it needs a block and none is
   free, the most recently added running request is preempted (recompute:
   its blocks freed, back to the *front* of the waiting queue, output tokens
   kept), repeatedly, until the allocation fits or the request preempted
   itself (then the running pass stops).
2. Only if nothing was preempted: waiting requests in FCFS order while the
   budget lasts and fewer than ``max_num_seqs`` run. The prefix-cache hit is
   looked up when the request is scheduled (whole blocks, at most
   ``num_tokens - 1`` tokens); it gets ``min(uncached tokens, budget)`` tokens;
   when its blocks do not fit, the waiting pass stops (head-of-line).
   Prefix-cache queries / hits (tokens) are counted when a request is first
   admitted; re-admissions after preemption are counted apart, as vLLM does
   (``PrefixCacheStats.record(..., preempted=True)`` is not exported).

Then ``update_after_step`` advances computed tokens, samples one token for
each request whose prompt is done, and finishes requests at their stop length
or at ``max_model_len``.

``plan_decode_run`` / ``apply_decode_run`` are the fast path: when the last
step was a pure decode step that admitted nothing, the next steps are the same
step again until a request finishes or the free blocks run out, so several of
them can be applied at once with identical results (see docs/simulator.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from misat_sim.config import EngineLimits
from misat_sim.kv_cache import BlockPool, KVCacheManager
from misat_sim.request import FinishReason, RequestStatus, SimRequest


@dataclass(slots=True)
class PrefixCacheCounters:
    """Prefix-cache lookups in tokens (vLLM's ``PrefixCacheStats``, cumulative)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


@dataclass(slots=True)
class ScheduleOutput:
    """What one step computes."""

    scheduled: list[tuple[SimRequest, int]] = field(default_factory=list)
    """(request, tokens computed this step) in scheduling order."""
    preempted: list[SimRequest] = field(default_factory=list)
    admitted: list[SimRequest] = field(default_factory=list)
    """Waiting requests that started (or resumed) running in this step."""
    prefill_tokens: int = 0
    decoding_seqs: int = 0
    kv_tokens_read: int = 0
    waiting_blocked: bool = False
    """The waiting pass ran and stopped with requests still waiting, or the
    queue was empty (no admission is possible without a finish)."""

    @property
    def is_pure_decode(self) -> bool:
        """Every scheduled request decoded one token and none was preempted or admitted."""
        return self.prefill_tokens == 0 and not self.preempted and not self.admitted and self.waiting_blocked


class Scheduler:
    """Waiting queue, running list and the per-step decisions of one engine."""

    def __init__(self, limits: EngineLimits) -> None:
        self.limits = limits
        self.block_size = limits.block_size
        self.max_num_seqs = limits.max_num_seqs
        self.max_num_batched_tokens = limits.max_num_batched_tokens
        self.max_model_len = limits.max_model_len
        self.pool = BlockPool(limits.num_gpu_blocks, enable_caching=limits.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, limits.block_size)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.prefix_cache = PrefixCacheCounters()
        self.num_preemptions = 0

    # --- queue edits ----------------------------------------------------------

    def add(self, req: SimRequest) -> None:
        """Queue a new request at the back of the waiting queue."""
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def remove(self, req: SimRequest) -> None:
        """Take a request out of whichever queue holds it and free its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # --- one step ------------------------------------------------------------

    def schedule(self) -> ScheduleOutput:
        """Choose this step's work (vLLM ``Scheduler.schedule``, FCFS)."""
        out = ScheduleOutput()
        scheduled = out.scheduled
        budget = self.max_num_batched_tokens
        kv = self.kv
        bs = self.block_size
        cap = self.max_model_len - 1
        running = self.running
        prefill_tokens = 0
        decoding = 0
        kv_read = 0

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            n = req.num_prompt_tokens + req.num_output_tokens - computed
            if n > budget:
                n = budget
            if computed + n > cap:
                n = cap - computed
            if n <= 0:
                i += 1
                continue
            after = computed + n
            if after > len(req.blocks) * bs:
                while not kv.allocate_slots(req, after):
                    victim = running.pop()
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is req:
                        break
                if req.status is not RequestStatus.RUNNING:
                    break
                kv.cache_full_blocks(req, after)
            elif after // bs > req.num_cached_blocks:
                kv.cache_full_blocks(req, after)
            scheduled.append((req, n))
            budget -= n
            kv_read += after
            if n == 1 and req.num_output_tokens > 0 and computed == req.num_tokens - 1:
                decoding += 1
            else:
                prefill_tokens += n
            i += 1

        if not out.preempted:
            waiting = self.waiting
            limits_hit = False
            while waiting and budget > 0:
                if len(running) >= self.max_num_seqs:
                    limits_hit = True
                    break
                req = waiting[0]
                num_tokens = req.num_tokens
                hit = kv.find_longest_hit(req, num_tokens - 1)
                computed = len(hit) * bs
                n = num_tokens - computed
                if n > budget:
                    n = budget
                if not kv.allocate_slots(req, computed + n, hit):
                    limits_hit = True
                    break
                waiting.popleft()
                running.append(req)
                counters = self.prefix_cache
                if kv.pool.enable_caching:
                    if req.num_preemptions == 0:
                        counters.requests += 1
                        counters.queries += num_tokens
                        counters.hits += computed
                    else:
                        counters.preempted_requests += 1
                        counters.preempted_queries += num_tokens
                        counters.preempted_hits += computed
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = computed
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = computed
                kv.cache_full_blocks(req, computed + n)
                scheduled.append((req, n))
                out.admitted.append(req)
                budget -= n
                prefill_tokens += n
                kv_read += computed + n
            out.waiting_blocked = limits_hit or not waiting
        out.prefill_tokens = prefill_tokens
        out.decoding_seqs = decoding
        out.kv_tokens_read = kv_read
        return out

    def update_after_step(self, out: ScheduleOutput) -> tuple[list[SimRequest], list[SimRequest]]:
        """Advance computed tokens and sample one token per completed prefill or decode.

        Returns (requests that emitted a token, requests that finished).
        """
        produced: list[SimRequest] = []
        finished: list[SimRequest] = []
        max_len = self.max_model_len
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_prompt_tokens + req.num_output_tokens:
                continue  # a prefill chunk that has not reached the end
            req.num_output_tokens += 1
            produced.append(req)
            if req.num_output_tokens >= req.stop_length:
                self._finish(req, FinishReason.STOP if req.stops_on_eos else FinishReason.LENGTH)
                finished.append(req)
            elif req.num_prompt_tokens + req.num_output_tokens >= max_len:
                self._finish(req, FinishReason.LENGTH)
                finished.append(req)
        return produced, finished

    def _finish(self, req: SimRequest, reason: FinishReason) -> None:
        req.finish_reason = reason
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED

    # --- fast path: runs of identical decode steps ---------------------------

    def plan_decode_run(self, max_steps: int) -> int:
        """How many identical pure-decode steps can run from now without an event.

        Valid right after a step whose output ``is_pure_decode``. The run
        ends at the step where the first request finishes (included), before
        the step that would need more new blocks than are free (a regular step
        must then preempt), and at ``max_steps``.
        """
        running = self.running
        if not running or len(running) > self.max_num_batched_tokens:
            return 0
        max_len = self.max_model_len
        k = max_steps
        for req in running:
            rem = req.stop_length - req.num_output_tokens
            by_len = max_len - req.num_prompt_tokens - req.num_output_tokens
            if by_len < rem:
                rem = by_len
            if rem < k:
                k = rem
        if k <= 0:
            return 0
        free = self.pool.num_free_blocks
        bs = self.block_size
        if self._new_blocks_for(k, bs) <= free:
            return k
        lo, hi = 0, k - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._new_blocks_for(mid, bs) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _new_blocks_for(self, steps: int, bs: int) -> int:
        total = 0
        for req in self.running:
            extra = -(-(req.num_computed_tokens + steps) // bs) - len(req.blocks)
            if extra > 0:
                total += extra
        return total

    def apply_decode_run(self, steps: int) -> tuple[int, list[SimRequest]]:
        """Apply ``steps`` decode steps at once; returns (KV tokens read in step 0, finished)."""
        kv = self.kv
        pool = self.pool
        bs = self.block_size
        max_len = self.max_model_len
        kv_read0 = 0
        finished: list[SimRequest] = []
        for req in self.running:
            kv_read0 += req.num_computed_tokens + 1
            after = req.num_computed_tokens + steps
            need = -(-after // bs) - len(req.blocks)
            if need > 0:
                req.blocks.extend(pool.allocate(need))
            if after // bs > req.num_cached_blocks:
                kv.cache_full_blocks(req, after)
            req.num_computed_tokens = after
            req.num_output_tokens += steps
            total = req.num_prompt_tokens + req.num_output_tokens
            if req.num_output_tokens >= req.stop_length or total >= max_len:
                finished.append(req)
        for req in finished:
            reason = (
                FinishReason.STOP
                if req.stops_on_eos and req.num_output_tokens >= req.stop_length
                else FinishReason.LENGTH
            )
            self._finish(req, reason)
        return kv_read0, finished
