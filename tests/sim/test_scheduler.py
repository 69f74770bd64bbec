"""vLLM V1 scheduling: chunked prefill, budgets, preemption, prefix-hit accounting, collapse."""

from __future__ import annotations

import random

import pytest

from misat_sim.request import RequestStatus


def _prompt(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget(make_engine) -> None:
    e = make_engine(max_num_batched_tokens=64)
    e.add_request("a", _prompt(150), 3, ignore_eos=True, arrival_time=0.0)
    chunks = []
    t = 0.0
    while e.get_request("a") is not None and e.get_request("a").num_output_tokens == 0:
        before = e.get_request("a").num_computed_tokens
        r = e.step(t)
        t = r.end
        chunks.append(e.get_request("a").num_computed_tokens - before)
    assert chunks == [64, 64, 22]


def test_decodes_go_first_and_prefill_gets_the_rest_of_the_budget(make_engine) -> None:
    e = make_engine(max_num_batched_tokens=64)
    for i in range(3):
        e.add_request(f"d{i}", _prompt(8, 100 * i), 50, ignore_eos=True, arrival_time=0.0)
    r = e.step(0.0)  # all three prefills fit (24 tokens)
    e.add_request("long", _prompt(200, 1000), 5, ignore_eos=True, arrival_time=r.end)
    e.step(r.end)
    assert e.get_request("long").num_computed_tokens == 64 - 3
    assert all(e.get_request(f"d{i}").num_output_tokens == 2 for i in range(3))


def test_max_num_seqs_bounds_the_running_batch(make_engine) -> None:
    e = make_engine(max_num_seqs=2)
    for i in range(5):
        e.add_request(f"r{i}", _prompt(4, 10 * i), 10, ignore_eos=True, arrival_time=0.0)
    e.step(0.0)
    assert e.num_running == 2 and e.num_waiting == 3


def test_preemption_takes_the_newest_running_request_and_recomputes_it(make_engine, drain) -> None:
    # 6 usable blocks of 4 tokens; two requests of 4 + 12 tokens cannot both finish.
    e = make_engine(num_gpu_blocks=7, max_model_len=24, max_num_batched_tokens=64)
    e.add_request("old", _prompt(4, 10), 12, ignore_eos=True, arrival_time=0.0)
    e.add_request("new", _prompt(4, 50), 12, ignore_eos=True, arrival_time=0.0)
    t = 0.0
    while e.counters.num_preemptions == 0:
        t = e.step(t).end
    new = e.get_request("new")
    assert e.get_request("old").status is RequestStatus.RUNNING
    assert new.status is RequestStatus.PREEMPTED and new.blocks == []
    assert e.scheduler.waiting[0] is new
    kept = new.num_output_tokens
    assert kept > 0  # output tokens survive a recompute preemption
    t = e.step(t).end
    done = drain(e)
    by_id = {f.request_id: f for f in done}
    assert len(by_id["new"].output_token_ids) == 12
    assert by_id["new"].num_preemptions >= 1
    assert done[0].request_id == "old"


def test_preempted_request_is_recomputed_with_its_output_tokens(make_engine) -> None:
    e = make_engine(
        num_gpu_blocks=7, max_model_len=24, max_num_batched_tokens=64, enable_prefix_caching=False
    )
    e.add_request("old", _prompt(4, 10), 12, ignore_eos=True, arrival_time=0.0)
    e.add_request("new", _prompt(4, 50), 12, ignore_eos=True, arrival_time=0.0)
    t = 0.0
    while e.counters.num_preemptions == 0:
        t = e.step(t).end
    new = e.get_request("new")
    while new.status is not RequestStatus.RUNNING:
        t = e.step(t).end
    # Re-admitted with no cache: prompt and kept output tokens are prefilled again.
    assert new.num_computed_tokens in (new.num_tokens, new.num_tokens - 1)


def test_prefix_hits_are_counted_in_whole_blocks_when_first_admitted(make_engine, drain) -> None:
    e = make_engine(block_size=4)
    e.add_request("a", _prompt(10), 2, ignore_eos=True, arrival_time=0.0)
    drain(e)
    q0 = e.sync_counters().prefix_cache_queries
    e.add_request("b", [*_prompt(10), 7, 7], 2, ignore_eos=True, arrival_time=1.0)
    (fin,) = drain(e)
    c = e.sync_counters()
    assert c.prefix_cache_queries - q0 == 12
    assert c.prefix_cache_hits == 8  # two full blocks of the shared 10 tokens
    assert fin.num_cached_tokens == 8


def test_a_fully_cached_prompt_still_recomputes_its_last_block(make_engine, drain) -> None:
    e = make_engine(block_size=4)
    e.add_request("a", _prompt(8), 1, ignore_eos=True, arrival_time=0.0)
    drain(e)
    e.add_request("b", _prompt(8), 1, ignore_eos=True, arrival_time=1.0)
    (fin,) = drain(e)
    assert fin.num_cached_tokens == 4  # hit capped at num_tokens - 1, in whole blocks


def _multi_turn_hit_rate(make_engine, sessions: int) -> tuple[float, int]:
    """Closed-loop multi-turn sessions with growing shared contexts on one small KV."""
    e = make_engine(
        block_size=16, num_gpu_blocks=121, max_model_len=1600, max_num_seqs=64, max_num_batched_tokens=512
    )
    rng = random.Random(1)
    contexts = {s: [rng.randrange(3, 2000) for _ in range(200)] for s in range(sessions)}
    turns = dict.fromkeys(contexts, 0)
    for s, ctx in contexts.items():
        e.add_request(f"{s}-0", ctx, 16, ignore_eos=True, arrival_time=0.0)
    t = 0.0
    while e.has_unfinished_requests():
        r = e.advance(t, float("inf"))
        t = r.end
        for f in r.finished:
            s = int(f.request_id.split("-")[0])
            turns[s] += 1
            if turns[s] < 6:
                contexts[s] = contexts[s] + f.output_token_ids + [rng.randrange(3, 2000) for _ in range(24)]
                e.add_request(f"{s}-{turns[s]}", contexts[s], 16, ignore_eos=True, arrival_time=t)
    c = e.sync_counters()
    return c.prefix_cache_hits / c.prefix_cache_queries, c.num_preemptions


def test_collapse_hit_rate_falls_and_preemptions_rise_when_sessions_oversubscribe_kv(make_engine) -> None:
    few_hit, few_preempt = _multi_turn_hit_rate(make_engine, 4)
    many_hit, many_preempt = _multi_turn_hit_rate(make_engine, 24)
    assert few_hit > 0.6
    assert many_hit < few_hit / 2
    assert many_preempt > few_preempt


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_advance_matches_stepping_one_by_one(make_engine, drain, caching: bool) -> None:
    def load(e) -> None:
        for i in range(12):
            e.add_request(
                f"r{i}", _prompt(5 + 7 * i, 10 + (i % 3)), 5 + 13 * i, ignore_eos=i % 2 == 0, arrival_time=0.0
            )

    a = make_engine(num_gpu_blocks=40, max_model_len=150, enable_prefix_caching=caching)
    b = make_engine(num_gpu_blocks=40, max_model_len=150, enable_prefix_caching=caching)
    load(a)
    load(b)
    stepped = drain(a)
    advanced = drain(b, use_advance=True)
    assert [(f.request_id, f.output_token_ids) for f in stepped] == [
        (f.request_id, f.output_token_ids) for f in advanced
    ]
    assert [f.finish_time for f in stepped] == pytest.approx([f.finish_time for f in advanced])
    ca, cb = a.sync_counters(), b.sync_counters()
    assert cb.busy_time == pytest.approx(ca.busy_time)
    cb.busy_time = ca.busy_time
    assert ca == cb
    assert a.counters.num_preemptions > 0  # the case exercises preemption too


def _open_loop(e, use_advance: bool, seed: int) -> tuple[list, dict[str, int]]:
    """Staggered arrivals sharing prefixes (EOS, greedy, length caps); returns finishes and token counts."""
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 60) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    arrivals = []
    t = 0.0
    for i in range(150):
        t += rng.expovariate(250.0)
        prompt = (rng.choice(bases) + [rng.randrange(3, 60) for _ in range(rng.randrange(1, 40))])[:100]
        max_tokens = max(1, min(rng.randrange(1, 90), e.limits.max_model_len - len(prompt) - 1))
        arrivals.append((t, f"r{i}", prompt, max_tokens, rng.random() < 0.6, rng.random() < 0.1))
    finished, tokens = [], {}
    now, i = 0.0, 0
    while i < len(arrivals) or e.has_unfinished_requests():
        while i < len(arrivals) and arrivals[i][0] <= now:
            _, rid, prompt, max_tokens, ignore_eos, greedy = arrivals[i]
            e.add_request(rid, prompt, max_tokens, ignore_eos=ignore_eos, arrival_time=now, greedy=greedy)
            i += 1
        nxt = arrivals[i][0] if i < len(arrivals) else float("inf")
        if not e.has_unfinished_requests():
            now = nxt
            continue
        r = e.advance(now, nxt) if use_advance else e.step(now)
        for rid, n in r.new_tokens.items():
            tokens[rid] = tokens.get(rid, 0) + n
        finished.extend(r.finished)
        now = max(now, r.end)
    return finished, tokens


@pytest.mark.parametrize("seed", [1, 2])
def test_lazy_decode_and_runs_match_stepping_under_staggered_load(make_engine, seed: int) -> None:
    """The per-event fast paths (lazy decode, decode runs) change nothing observable."""

    def engine():
        return make_engine(num_gpu_blocks=60, max_model_len=160, max_num_seqs=12, max_num_batched_tokens=48)

    a, b = engine(), engine()
    stepped, tokens_a = _open_loop(a, False, seed)
    advanced, tokens_b = _open_loop(b, True, seed)
    assert [(f.request_id, f.output_token_ids, f.num_cached_tokens, f.num_preemptions) for f in stepped] == [
        (f.request_id, f.output_token_ids, f.num_cached_tokens, f.num_preemptions) for f in advanced
    ]
    assert [f.finish_time for f in stepped] == pytest.approx([f.finish_time for f in advanced])
    assert [f.first_token_time for f in stepped] == pytest.approx([f.first_token_time for f in advanced])
    assert tokens_a == tokens_b == {f.request_id: len(f.output_token_ids) for f in stepped}
    ca, cb = a.sync_counters(), b.sync_counters()
    assert cb.busy_time == pytest.approx(ca.busy_time)
    cb.busy_time = ca.busy_time
    assert ca == cb
    assert ca.num_preemptions > 0 and ca.prefix_cache_hits > 0


def test_counts_of_a_lazily_decoding_request_read_exactly(make_engine) -> None:
    e = make_engine()
    e.add_request("a", _prompt(10), 40, ignore_eos=True, arrival_time=0.0)
    r = e.advance(0.0, 0.05)
    req = e.get_request("a")
    assert req.num_output_tokens == r.new_tokens["a"] == r.num_steps
    assert req.num_computed_tokens == req.num_tokens - 1
    assert len(e.output_token_ids("a")) == req.num_output_tokens
    assert len(req.blocks) == -(-req.num_computed_tokens // e.limits.block_size)


def test_advance_without_token_counts_runs_the_same_and_refuses_to_count(make_engine) -> None:
    counted, uncounted = make_engine(), make_engine()
    for e in (counted, uncounted):
        e.add_request("a", _prompt(10), 40, ignore_eos=True, arrival_time=0.0)
    r1 = counted.advance(0.0, 0.05)
    r2 = uncounted.advance(0.0, 0.05, count_tokens=False)
    assert (r2.num_steps, r2.end) == (r1.num_steps, r1.end) and r1.new_tokens["a"] == r1.num_steps
    assert counted.get_request("a").num_output_tokens == uncounted.get_request("a").num_output_tokens
    with pytest.raises(RuntimeError, match="count_tokens=False"):
        _ = r2.new_tokens
