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

Why a step costs per event, not per running request: most running requests
are in *steady decode* (every prompt token computed, one new token per
step). Such a request is kept *lazy*: its token counts are a base plus the
number of steps run since (``StepCounter``), the batch's decode count and KV
read are running sums, and it is looked at only at its events: the step where
one of its blocks fills (hash it, register it in the prefix cache), the step
where it needs a new block (allocate, maybe preempt), its finish, or its
preemption. Events sit in heaps keyed by (step, running order), so they are
handled in exactly the order the step-by-step algorithm would. Everything
else (prefill chunks, admissions, a step whose token budget does not cover
every running request) runs vLLM's algorithm request by request, as before.

``run_decode_steps`` is the fast path over several steps: after a pure decode
step, the next steps are the same step again (each lazy request one token
further) until a request finishes, a block is needed and none is free, or the
caller's time runs out; they are applied at once, their block events in step
order (see docs/simulator.md).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from misat_sim.config import EngineLimits
from misat_sim.kv_cache import BlockPool, KVCacheManager
from misat_sim.request import FinishReason, RequestStatus, SimRequest, StepCounter


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
    """(request, tokens computed this step) in scheduling order, lazy decodes excepted."""
    lazy_seqs: int = 0
    """Lazy (steady-decode) requests that also decode one token in this step."""
    preempted: list[SimRequest] = field(default_factory=list)
    admitted: list[SimRequest] = field(default_factory=list)
    """Waiting requests that started (or resumed) running in this step."""
    prefill_tokens: int = 0
    prefill_attn_pairs: int = 0
    """Sum over prefill chunks of (new tokens x tokens each attends to): attention compute."""
    decoding_seqs: int = 0
    kv_tokens_read: int = 0
    waiting_blocked: bool = False
    """The waiting pass ran and stopped with requests still waiting, or the
    queue was empty (no admission is possible without a finish)."""
    kv_blocked: bool = False
    """The waiting pass stopped because the head's blocks did not fit. Caching
    or evicting a block can change that, so such a step starts no decode run."""

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
        self.clock = StepCounter()
        """Steps run so far; lazy requests read their counts through it."""
        self._run_seq = 0
        self._explicit: dict[SimRequest, None] = {}
        """Running requests whose counts are explicit (prefilling, or at an event)."""
        self._lazy: dict[SimRequest, int] = {}
        """Running requests in lazy decode -> the step count their base was taken at."""
        self._lazy_c = 0
        """Sum over lazy requests of (base computed tokens - base step)."""
        self._ev_heap: list[tuple[int, int, SimRequest]] = []
        self._fin_heap: list[tuple[int, int, SimRequest]] = []
        self.call_g0 = 0
        """Step count when the engine's current call began (for its token counts)."""
        self.call_tokens: dict[str, int] = {}
        """Tokens emitted per request id in the engine's current call, lazy ones aside."""

    # --- queue edits ----------------------------------------------------------

    def add(self, req: SimRequest) -> None:
        """Queue a new request at the back of the waiting queue."""
        req.status = RequestStatus.WAITING
        req._clock = self.clock
        self.waiting.append(req)

    def remove(self, req: SimRequest) -> None:
        """Take a request out of whichever queue holds it and free its blocks."""
        if req.status == RequestStatus.RUNNING:
            if req._bg >= 0:
                self._delazify(req)
            self.running.remove(req)
            del self._explicit[req]
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED

    def preempt_running(self) -> int:
        """Preempt every running request between steps (vLLM's ``reset_prefix_cache`` with
        ``reset_running_requests``): last first, so they go back to the head of the waiting
        queue in their running order and recompute from scratch. Returns how many."""
        running = self.running
        n = len(running)
        while running:
            self._preempt(running.pop())
        return n

    def _preempt(self, req: SimRequest) -> None:
        if req._bg >= 0:
            self._delazify(req)
        del self._explicit[req]
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req._comp = 0
        # Its heap entries die with its run (run_seq); forget the finish step too, or a rerun that
        # recomputes in one step (same finish step) would not queue its finish again and never end.
        req._fin = -1
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # --- lazy decode bookkeeping ---------------------------------------------

    def _lazify(self, req: SimRequest) -> None:
        """Put a running request in steady decode (computed == tokens - 1) into lazy mode."""
        g = self.clock.g
        comp = req._comp
        out = req._out
        req._bg = g
        self._lazy[req] = g
        self._lazy_c += comp - g
        del self._explicit[req]
        bs = self.block_size
        ev = g + len(req.blocks) * bs - comp + 1  # the step whose token needs a new block
        if self.pool.enable_caching:
            fill = g + (req.num_cached_blocks + 1) * bs - comp  # the step that fills a block
            if fill < ev:
                ev = fill
        req._ev = ev
        heapq.heappush(self._ev_heap, (ev, req.run_seq, req))
        rem = req.stop_length - out
        by_len = self.max_model_len - req.num_prompt_tokens - out
        fin = g + (by_len if by_len < rem else rem)
        if fin != req._fin:
            req._fin = fin
            heapq.heappush(self._fin_heap, (fin, req.run_seq, req))

    def _delazify(self, req: SimRequest) -> None:
        """Make a lazy request's counts explicit at the current step count."""
        g = self.clock.g
        bg = req._bg
        k = g - bg
        self._lazy_c -= req._comp - bg
        req._out += k
        req._comp += k
        req._bg = -1
        del self._lazy[req]
        self._explicit[req] = None
        g0 = self.call_g0
        k = g - (bg if bg > g0 else g0)
        if k > 0:
            rid = req.request_id
            self.call_tokens[rid] = self.call_tokens.get(rid, 0) + k

    def _block_event(self, req: SimRequest, step: int) -> bool:
        """Handle a lazy request's block event in step ``step`` in place; False if no block is free.

        The step's token fills a block (hash and register it) or needs a new
        one (allocate it); then the next event is queued. The clock must read
        ``step - 1``.
        """
        bs = self.block_size
        after = req._comp + step - req._bg
        blocks = req.blocks
        if after > len(blocks) * bs:
            if not self.pool.num_free_blocks:
                return False
            blocks.extend(self.pool.allocate(1))
        ev = step + len(blocks) * bs - after + 1
        if self.pool.enable_caching:
            if after // bs > req.num_cached_blocks:
                self.kv.cache_full_blocks(req, after)
            fill = step + (req.num_cached_blocks + 1) * bs - after
            if fill < ev:
                ev = fill
        req._ev = ev
        heapq.heappush(self._ev_heap, (ev, req.run_seq, req))
        return True

    def lazy_snapshot(self) -> list[tuple[SimRequest, int]]:
        """(request, base step) of every lazy request, for a caller's token counts."""
        return list(self._lazy.items())

    @property
    def num_lazy(self) -> int:
        """Running requests in lazy decode."""
        return len(self._lazy)

    def lazy_kv_read(self) -> int:
        """KV tokens the lazy requests read in the next step (context + the new token each)."""
        n = len(self._lazy)
        return self._lazy_c + n * self.clock.g + n

    def _pop_due(self, heap: list[tuple[int, int, SimRequest]], step: int, fin: bool) -> list[SimRequest]:
        """Valid lazy entries of ``heap`` due at or before ``step``, in running order."""
        due: list[SimRequest] = []
        pop = heapq.heappop
        while heap and heap[0][0] <= step:
            s, seq, req = pop(heap)
            if req._bg >= 0 and req.run_seq == seq:
                if fin and req._fin == s:
                    req._fin = -1  # a duplicate entry (same step) must not match again
                    due.append(req)
                elif not fin and req._ev == s:
                    req._ev = -1
                    due.append(req)
        return due

    # --- one step ------------------------------------------------------------

    def schedule(self) -> ScheduleOutput:
        """Choose this step's work (vLLM ``Scheduler.schedule``, FCFS)."""
        due = self._pop_due(self._ev_heap, self.clock.g + 1, False)
        explicit = list(self._explicit)
        cap = self.max_model_len - 1
        demand = len(self._lazy)
        for req in explicit:
            computed = req._comp
            n = req.num_prompt_tokens + req._out - computed
            if computed + n > cap:
                n = cap - computed
            if n > 0:
                demand += n
        if demand > self.max_num_batched_tokens:
            # The budget runs out part-way: order decides who waits, so go request by request.
            for req in list(self._lazy):
                self._delazify(req)
            return self._schedule(self.running)
        if due:
            # Lazy requests at a block event are handled in place, in running order.
            explicit.extend(due)
        if len(explicit) > 1:
            explicit.sort(key=_run_order)
        return self._schedule(explicit)

    def _schedule(self, order: list[SimRequest]) -> ScheduleOutput:
        """vLLM's step over the explicit requests ``order`` (in running order); lazy ones decode."""
        out = ScheduleOutput()
        scheduled = out.scheduled
        kv = self.kv
        bs = self.block_size
        cap = self.max_model_len - 1
        running = self.running
        lazy = self._lazy
        budget = self.max_num_batched_tokens - len(lazy)
        prefill_tokens = 0
        attn_pairs = 0
        decoding = 0
        kv_read = 0

        is_running = running is order
        step = self.clock.g + 1
        i = 0
        while i < len(order) and budget > 0:
            req = order[i]
            i += 1
            if not is_running:
                if req.status is not RequestStatus.RUNNING:
                    continue  # preempted earlier in this pass
                if req._bg >= 0:
                    if self._block_event(req, step):
                        continue  # decodes lazily, counted below
                    self._delazify(req)  # needs a block and none is free: preemption, as below
                    budget += 1
            computed = req._comp
            n = req.num_prompt_tokens + req._out - computed
            if n > budget:
                n = budget
            if computed + n > cap:
                n = cap - computed
            if n <= 0:
                continue
            after = computed + n
            if after > len(req.blocks) * bs:
                while not kv.allocate_slots(req, after):
                    victim = running.pop()
                    if victim._bg >= 0:
                        budget += 1  # a lazy victim no longer decodes this step
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
            if n == 1 and req._out > 0 and computed == req.num_prompt_tokens + req._out - 1:
                decoding += 1
            else:
                prefill_tokens += n
                attn_pairs += n * (after - n) + n * (n + 1) // 2

        if not out.preempted:
            waiting = self.waiting
            limits_hit = False
            while waiting and budget > 0:
                if len(running) >= self.max_num_seqs:
                    limits_hit = True
                    break
                req = waiting[0]
                num_tokens = req.num_prompt_tokens + req._out
                hit = kv.find_longest_hit(req, num_tokens - 1)
                computed = len(hit) * bs
                n = num_tokens - computed
                if n > budget:
                    n = budget
                if not kv.allocate_slots(req, computed + n, hit):
                    limits_hit = True
                    out.kv_blocked = True
                    break
                waiting.popleft()
                running.append(req)
                self._explicit[req] = None
                req.run_seq = self._run_seq
                self._run_seq += 1
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
                req._comp = computed
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = computed
                kv.cache_full_blocks(req, computed + n)
                scheduled.append((req, n))
                out.admitted.append(req)
                budget -= n
                prefill_tokens += n
                attn_pairs += n * computed + n * (n + 1) // 2
                kv_read += computed + n
            out.waiting_blocked = limits_hit or not waiting
        n_lazy = len(lazy)
        out.lazy_seqs = n_lazy
        out.prefill_tokens = prefill_tokens
        out.prefill_attn_pairs = attn_pairs
        out.decoding_seqs = decoding + n_lazy
        out.kv_tokens_read = kv_read + self._lazy_c + n_lazy * self.clock.g + n_lazy
        return out

    def update_after_step(self, out: ScheduleOutput) -> tuple[list[SimRequest], list[SimRequest]]:
        """Advance computed tokens and sample one token per completed prefill or decode.

        Lazy requests advance by moving the step count. Returns (explicit
        requests that emitted a token, requests that finished); the lazy ones
        emitted ``out.lazy_seqs`` tokens besides.
        """
        produced: list[SimRequest] = []
        done: list[tuple[SimRequest, FinishReason]] = []
        max_len = self.max_model_len
        self.clock.g += 1
        for req, n in out.scheduled:
            req._comp += n
            if req._comp < req.num_prompt_tokens + req._out:
                continue  # a prefill chunk that has not reached the end
            req._out += 1
            produced.append(req)
            if req._out >= req.stop_length:
                done.append((req, FinishReason.STOP if req.stops_on_eos else FinishReason.LENGTH))
            elif req.num_prompt_tokens + req._out >= max_len:
                done.append((req, FinishReason.LENGTH))
            else:
                self._lazify(req)
        if self._fin_heap and self._fin_heap[0][0] <= self.clock.g:
            self._due_lazy_finishes(done)
        finished: list[SimRequest] = []
        if done:
            if len(done) > 1:
                # Free in scheduling order, as vLLM does: it decides the LRU order of their blocks.
                done.sort(key=_first_run_order)
            for req, reason in done:
                self._finish(req, reason)
                finished.append(req)
        return produced, finished

    def _due_lazy_finishes(self, done: list[tuple[SimRequest, FinishReason]]) -> None:
        """Lazy requests whose last token was emitted in the step just run, with their reasons."""
        for req in self._pop_due(self._fin_heap, self.clock.g, True):
            self._delazify(req)
            if req._out >= req.stop_length:
                done.append((req, FinishReason.STOP if req.stops_on_eos else FinishReason.LENGTH))
            else:
                done.append((req, FinishReason.LENGTH))

    def _finish(self, req: SimRequest, reason: FinishReason) -> None:
        req.finish_reason = reason
        self.running.remove(req)
        del self._explicit[req]
        self.kv.free(req)
        req.status = RequestStatus.FINISHED

    # --- fast path: runs of identical decode steps ---------------------------

    def can_run_decode_steps(self, last: ScheduleOutput) -> bool:
        """Whether the steps after ``last`` repeat it (see ``run_decode_steps``)."""
        return (
            last.is_pure_decode
            and not last.kv_blocked
            and not self._explicit
            and 0 < len(self._lazy) <= self.max_num_batched_tokens
        )

    def steps_to_next_finish(self) -> int:
        """Steps from now until (and including) the first lazy request's finish."""
        heap = self._fin_heap
        while heap:
            s, seq, req = heap[0]
            if req._bg >= 0 and req.run_seq == seq and req._fin == s:
                return s - self.clock.g
            heapq.heappop(heap)
        return 1 << 62

    def run_decode_steps(self, steps: int) -> tuple[int, list[SimRequest]]:
        """Run up to ``steps`` identical pure-decode steps at once.

        Valid when ``can_run_decode_steps`` held after the last step and
        ``steps <= steps_to_next_finish()``. Block events are handled in the
        order stepping would; the run stops before a step whose new blocks
        do not all fit (that step must preempt, so it runs as a regular step).
        Returns (steps run, requests that finished in the last one).
        """
        clock = self.clock
        g = clock.g
        target = g + steps
        heap = self._ev_heap
        pool = self.pool
        bs = self.block_size
        pop = heapq.heappop
        push = heapq.heappush
        while heap and heap[0][0] <= target:
            s = heap[0][0]
            batch: list[SimRequest] = []
            need = 0
            while heap and heap[0][0] == s:
                _, seq, req = pop(heap)
                if req._bg >= 0 and req.run_seq == seq and req._ev == s:
                    req._ev = -1  # a duplicate entry (same step) must not match again
                    batch.append(req)
                    if req._comp + s - req._bg > len(req.blocks) * bs:
                        need += 1
            if need > pool.num_free_blocks:
                for req in batch:
                    req._ev = s
                    push(heap, (s, req.run_seq, req))
                target = s - 1
                break
            clock.g = s - 1  # tokens up to the block being hashed exist by then
            for req in batch:
                self._block_event(req, s)
        clock.g = target
        finished: list[SimRequest] = []
        if target > g and self._fin_heap and self._fin_heap[0][0] <= target:
            done: list[tuple[SimRequest, FinishReason]] = []
            self._due_lazy_finishes(done)  # popped in running order
            for req, reason in done:
                self._finish(req, reason)
                finished.append(req)
        return target - g, finished


def _run_order(req: SimRequest) -> int:
    return req.run_seq


def _first_run_order(item: tuple[SimRequest, FinishReason]) -> int:
    return item[0].run_seq
