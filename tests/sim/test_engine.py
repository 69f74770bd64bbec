"""Engine model: determinism, EOS, aborts, profiles and config resolution."""

from __future__ import annotations

import pytest

from misat_sim.config import SimEngineConfig
from misat_sim.profiles import PROFILES, QWEN30B_KV_TOKENS
from misat_sim.request import FinishReason
from misat_sim.scale import DEFAULT_LENGTH_SCALE


def _load(e, seed_prompts: int = 6) -> None:
    for i in range(seed_prompts):
        e.add_request(
            f"r{i}", list(range(10, 30 + 9 * i)), 20 + 5 * i, ignore_eos=False, arrival_time=0.1 * i
        )


def test_same_seed_gives_same_tokens_and_finish_order(make_engine, drain) -> None:
    runs = []
    for _ in range(2):
        e = make_engine(seed=7)
        _load(e)
        runs.append([(f.request_id, f.output_token_ids, f.finish_time) for f in drain(e)])
    assert runs[0] == runs[1]
    other = make_engine(seed=8)
    _load(other)
    assert [f.output_token_ids for f in drain(other)] != [ids for _, ids, _ in runs[0]]


def test_identical_prompts_sample_differently_unless_greedy(make_engine, drain) -> None:
    e = make_engine()
    for rid in ("a", "b"):
        e.add_request(rid, [5, 6, 7], 8, ignore_eos=True, arrival_time=0.0)
    for rid in ("g1", "g2"):
        e.add_request(rid, [5, 6, 7], 8, ignore_eos=True, arrival_time=0.0, greedy=True)
    out = {f.request_id: f.output_token_ids for f in drain(e)}
    assert out["a"] != out["b"]
    assert out["g1"] == out["g2"]


def test_eos_stops_a_request_unless_ignored(make_engine, drain) -> None:
    # A tiny vocabulary makes a sampled EOS likely within 200 tokens.
    e = make_engine()
    eos = e.limits.eos_token_id
    for i in range(20):
        e.add_request(f"s{i}", [10 + i, 11], 200, ignore_eos=False, arrival_time=0.0)
        e.add_request(f"i{i}", [10 + i, 12], 200, ignore_eos=True, arrival_time=0.0)
    done = {f.request_id: f for f in drain(e)}
    stopped = [f for rid, f in done.items() if rid.startswith("s") and f.finish_reason is FinishReason.STOP]
    assert stopped, "no request hit EOS"
    for f in stopped:
        assert f.output_token_ids[-1] == eos and eos not in f.output_token_ids[:-1]
        assert len(f.output_token_ids) < 200
    for i in range(20):
        assert done[f"i{i}"].finish_reason is FinishReason.LENGTH
        assert len(done[f"i{i}"].output_token_ids) == 200


def test_max_model_len_caps_output(make_engine, drain) -> None:
    e = make_engine(max_model_len=40)
    e.add_request("a", list(range(10, 30)), 20, ignore_eos=True, arrival_time=0.0)
    (f,) = drain(e)
    assert f.finish_reason is FinishReason.LENGTH and len(f.output_token_ids) == 20


def test_abort_frees_blocks_and_counts(make_engine) -> None:
    e = make_engine()
    e.add_request("a", list(range(10, 50)), 100, ignore_eos=True, arrival_time=0.0)
    e.step(0.0)
    assert e.kv_cache_usage() > 0
    assert e.abort_request("a") is True
    assert e.kv_cache_usage() == 0.0 and not e.has_unfinished_requests()
    assert e.counters.request_success["abort"] == 1
    assert e.abort_request("a") is False


def test_a_reset_with_running_requests_preempts_them_and_they_recompute_whole(make_engine, drain) -> None:
    def run(reset: bool) -> tuple:
        e = make_engine(seed=5, num_gpu_blocks=200)  # room for all three: no preemption of its own
        for i in range(3):
            e.add_request(f"r{i}", list(range(10 + i, 60 + i)), 80, ignore_eos=True, arrival_time=0.0)
        t = 0.0
        for _ in range(12):
            t = e.step(t).end
        if reset:
            # Blocks in use: a plain reset is refused (vLLM's rule); with the running requests
            # preempted first it goes through and they recompute.
            assert e.reset_prefix_cache() is False
            running = e.num_running
            assert running == 3 and e.reset_prefix_cache(reset_running_requests=True) is True
            assert e.num_running == 0 and e.num_waiting == running and e.kv_cache_usage() == 0.0
            assert e.counters.num_preemptions == running
        done = {f.request_id: f for f in drain(e)}
        return {rid: (f.output_token_ids, f.finish_reason, f.num_preemptions) for rid, f in done.items()}

    plain, reset = run(False), run(True)
    # The same tokens, whole: a preemption keeps the output so far and recomputes it.
    assert {rid: v[:2] for rid, v in reset.items()} == {rid: v[:2] for rid, v in plain.items()}
    assert all(len(ids) == 80 for ids, _, _ in reset.values())
    assert [v[2] for v in reset.values()] == [1, 1, 1] and [v[2] for v in plain.values()] == [0, 0, 0]


def test_step_times_grow_with_work(make_engine) -> None:
    e = make_engine()
    idle = e.step(0.0)
    assert idle.num_steps == 0 and idle.duration == 0.0
    e.add_request("a", list(range(10, 70)), 4, ignore_eos=True, arrival_time=0.0)
    prefill = e.step(0.0)
    decode = e.step(prefill.end)
    assert prefill.duration > decode.duration > e.limits.step_time.fixed_overhead_s


def test_length_scale_applies_to_kv_and_context_but_not_tiny_cpu() -> None:
    q = SimEngineConfig(profile="qwen30b-a3b-h100").resolve()
    assert q.length_scale == DEFAULT_LENGTH_SCALE
    assert q.max_model_len == 131072 // 16
    assert q.num_gpu_blocks == int(QWEN30B_KV_TOKENS * DEFAULT_LENGTH_SCALE) // 16
    base = PROFILES["qwen30b-a3b-h100"].step_time.kv_read_s_per_token
    assert q.step_time.kv_read_s_per_token == pytest.approx(base * 16)
    t = SimEngineConfig(profile="tiny-cpu").resolve()
    assert (t.length_scale, t.block_size, t.max_model_len) == (1.0, 128, 2048)


def test_profiles_are_frozen_and_unknown_names_fail() -> None:
    with pytest.raises(ValueError, match="unknown engine profile"):
        SimEngineConfig(profile="nope").resolve()
    with pytest.raises(ValueError, match="smaller than max_model_len"):
        SimEngineConfig(profile="tiny-cpu", num_gpu_blocks=4).resolve()
    p = PROFILES["step3.7-h200"]
    with pytest.raises(Exception):  # noqa: B017 - pydantic frozen instance error
        p.block_size = 32  # type: ignore[misc]
    assert 1_000_000 < p.kv_capacity_tokens < 1_600_000


def test_known_prefix_hashes_give_the_hashes_computed_from_scratch(make_engine) -> None:
    from misat_sim.engine import _prompt_block_hashes
    from misat_sim.kv_cache import block_hashes_for

    prompt = list(range(10, 40))  # 7 full blocks of 4 and 2 tokens over
    full = block_hashes_for(prompt, 4)
    for known in (full[:0], full[:3], full, [*full, 123]):
        assert _prompt_block_hashes(prompt, 4, known) == full
    assert _prompt_block_hashes(prompt[:3], 4, full) == []  # shorter than one block


def test_discarded_output_ids_are_never_drawn_and_say_so(make_engine, drain) -> None:
    def run(discard: bool) -> dict:
        e = make_engine(seed=7, num_gpu_blocks=34, max_model_len=128)  # 2 x (50 + 40) tokens > 33 x 4
        e.add_request("kept", list(range(10, 60)), 40, ignore_eos=True, arrival_time=0.0)
        e.add_request("gone", list(range(10, 60)), 40, ignore_eos=True, arrival_time=0.0,
                      discard_output_ids=discard)
        e.step(0.0)
        if discard:
            with pytest.raises(RuntimeError, match="'gone' was added with discard_output_ids"):
                e.output_token_ids("gone")
        return {f.request_id: f for f in drain(e)}

    drawn, discarded = run(False), run(True)
    assert discarded["gone"].output_token_ids == [] and discarded["gone"].num_output_tokens == 40
    assert discarded["kept"].output_token_ids == drawn["kept"].output_token_ids
    for rid in ("kept", "gone"):
        a, b = drawn[rid], discarded[rid]
        assert (a.num_cached_tokens, a.num_preemptions, a.first_token_time, a.finish_time, a.num_output_tokens) == (
            b.num_cached_tokens, b.num_preemptions, b.first_token_time, b.finish_time, b.num_output_tokens)
    assert drawn["gone"].num_preemptions + drawn["kept"].num_preemptions > 0
