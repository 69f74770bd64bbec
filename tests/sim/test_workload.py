"""Workload generators: fitted shapes, GRPO groups, agentic growth, determinism, phases."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
from pydantic import ValidationError

from misat_sim.scale import DEFAULT_LENGTH_SCALE
from misat_sim.workload import (
    AGENTIC_INPUT,
    AGENTIC_OUTPUT,
    RLHF_INPUT,
    RLHF_OUTPUT,
    RLVR_INPUT,
    RLVR_OUTPUT,
    RLVR_OUTPUT_CAP_TOKENS,
    LengthDist,
    MixtureDrawer,
    RolloutClass,
    Workload,
    WorkloadSpec,
    length_drift_spec,
    mix_shift_spec,
    normalise_mixture,
    plan_agentic,
    plan_group,
    plan_release,
)

RLVR, RLHF, AGENTIC = RolloutClass.RLVR, RolloutClass.RLHF, RolloutClass.AGENTIC

# Unscaled, one sample per group (each draw an independent sample of the fitted law), and
# a context limit far above the trace, so it trims nothing: this checks the fit itself.
FULL_SCALE = WorkloadSpec(
    length_scale=1.0, group_size={RLVR: 1, RLHF: 1}, max_context_tokens=10**8
)
N_SINGLE = 4000
"""Samples per single-request statistic: the share below p95 then has a standard error
of sqrt(0.95 * 0.05 / 4000) = 0.0034, below p50 of 0.0079."""


def share_below(values: list[float], threshold: float) -> float:
    return sum(v < threshold for v in values) / len(values)


def rel_quantile_err(values: list[float], q: float, expected: float) -> float:
    ordered = sorted(values)
    return abs(ordered[int(q * len(ordered))] / expected - 1.0)


# --- fitted distributions ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("dist", "sigma"),
    [
        pytest.param(RLVR_INPUT, 1.2033, id="rlvr-in"),
        pytest.param(RLVR_OUTPUT, 0.6148, id="rlvr-out"),
        pytest.param(RLHF_INPUT, 2.2829, id="rlhf-in"),
        pytest.param(RLHF_OUTPUT, 0.7311, id="rlhf-out"),
        pytest.param(AGENTIC_INPUT, 0.6114, id="agentic-in"),
        pytest.param(AGENTIC_OUTPUT, 1.4518, id="agentic-out"),
    ],
)
def test_fit_reproduces_table_quantiles_and_documented_sigma(dist: LengthDist, sigma: float):
    assert dist.quantile(0.5) == pytest.approx(dist.p50, rel=1e-9)
    assert dist.quantile(0.95) == pytest.approx(dist.p95, rel=1e-9)
    assert dist.sigma == pytest.approx(sigma, abs=5e-4)  # the value written in docs/workloads.md


def test_length_dist_rejects_inverted_quantiles():
    with pytest.raises(ValidationError, match="p95"):
        LengthDist(p50=100, p95=50)


@pytest.mark.parametrize(
    ("klass", "field", "dist"),
    [
        pytest.param(RLVR, "input", RLVR_INPUT, id="rlvr-in"),
        pytest.param(RLVR, "output", RLVR_OUTPUT, id="rlvr-out"),
        pytest.param(RLHF, "input", RLHF_INPUT, id="rlhf-in"),
        pytest.param(RLHF, "output", RLHF_OUTPUT, id="rlhf-out"),
    ],
)
def test_single_request_samples_match_table_before_scaling(klass, field, dist):
    plans = [plan_group(FULL_SCALE, klass, i)[0] for i in range(N_SINGLE)]
    turn = [p.turns[0] for p in plans]
    values = [t.append_len if field == "input" else t.max_tokens for t in turn]
    # Share below the table's quantiles: independent of sigma, tight (about 3.5 SE).
    assert share_below(values, dist.p50) == pytest.approx(0.5, abs=0.03)
    assert share_below(values, dist.p95) == pytest.approx(0.95, abs=0.012)
    assert rel_quantile_err(values, 0.5, dist.p50) < 0.08


def test_rlvr_output_is_capped_at_the_128k_context():
    spec = WorkloadSpec(length_scale=1.0, group_size={RLVR: 16})
    turns = [p.turns[0] for i in range(300) for p in plan_group(spec, RLVR, i)]
    totals = [t.append_len + t.max_tokens for t in turns]
    assert max(totals) == RLVR_OUTPUT_CAP_TOKENS == spec.max_context_tokens
    # The tail reaches the cap and stops there; about 5% of samples (p95 is just below it).
    assert 0.01 < sum(n == RLVR_OUTPUT_CAP_TOKENS for n in totals) / len(totals) < 0.07


def agentic_turn_lengths(spec: WorkloadSpec, n: int) -> tuple[list[int], list[int], list[int]]:
    inputs, outputs, turns = [], [], []
    for i in range(n):
        plan = plan_agentic(spec, i)
        inputs += plan.planned_prompt_lens()
        outputs += [t.max_tokens for t in plan.turns]
        turns.append(len(plan.turns))
    return inputs, outputs, turns


def test_agentic_per_turn_lengths_match_table_before_scaling():
    inputs, outputs, turns = agentic_turn_lengths(FULL_SCALE, 1500)
    assert share_below(inputs, AGENTIC_INPUT.p50) == pytest.approx(0.5, abs=0.04)
    assert share_below(inputs, AGENTIC_INPUT.p95) == pytest.approx(0.95, abs=0.015)
    assert share_below(outputs, AGENTIC_OUTPUT.p50) == pytest.approx(0.5, abs=0.03)
    assert share_below(outputs, AGENTIC_OUTPUT.p95) == pytest.approx(0.95, abs=0.012)
    # ~70 turns at full scale, times the default turn_scale of 1/4.
    assert sorted(turns)[len(turns) // 2] == pytest.approx(70 * 0.25, abs=1.5)


def test_scaling_divides_lengths_by_sixteen_by_default():
    assert WorkloadSpec().length_scale == DEFAULT_LENGTH_SCALE == 1 / 16
    spec = WorkloadSpec(group_size={RLVR: 1})
    outs = [plan_group(spec, RLVR, i)[0].turns[0].max_tokens for i in range(N_SINGLE)]
    assert max(outs) <= RLVR_OUTPUT_CAP_TOKENS / 16
    assert rel_quantile_err(outs, 0.5, RLVR_OUTPUT.p50 / 16) < 0.08
    # Same draws as at full scale, only scaled.
    full = plan_group(FULL_SCALE, RLVR, 7)[0].turns[0].max_tokens
    assert full < 100_000  # (not clipped by the context in either spec)
    assert plan_group(spec, RLVR, 7)[0].turns[0].max_tokens == round(full / 16)


def test_prompt_scale_keeps_grpo_prompts_long_while_outputs_scale():
    scaled = plan_group(WorkloadSpec(), RLVR, 2)[0].turns[0]
    kept = plan_group(WorkloadSpec(prompt_scale=1.0), RLVR, 2)[0].turns[0]
    full = plan_group(FULL_SCALE, RLVR, 2)[0].turns[0]
    assert kept.append_len == full.append_len == pytest.approx(16 * scaled.append_len, abs=8)
    assert kept.max_tokens == scaled.max_tokens


# --- plan structure ----------------------------------------------------------------------


@pytest.mark.parametrize(("klass", "size"), [(RLVR, 16), (RLHF, 8)], ids=["rlvr", "rlhf"])
def test_grpo_group_shares_one_prompt(klass, size):
    spec = WorkloadSpec(seed=3)
    group = plan_group(spec, klass, 5)
    assert len(group) == size
    prompts = {tuple(p.initial_prompt()) for p in group}
    assert len(prompts) == 1
    assert len({p.session_id for p in group}) == size
    assert {p.group_id for p in group} == {"w3-" + klass.value + "-g5"}
    assert tuple(plan_group(spec, klass, 6)[0].initial_prompt()) not in prompts
    assert all(len(p.turns) == 1 for p in group)


def test_agentic_context_grows_and_next_prompt_extends_the_previous():
    spec = WorkloadSpec(seed=1)
    plan = plan_agentic(spec, 4)
    lens = plan.planned_prompt_lens()
    assert len(lens) >= 2
    assert all(b > a for a, b in itertools.pairwise(lens))
    prompt = plan.initial_prompt()
    for t in range(1, len(plan.turns)):
        output = [7] * plan.turns[t - 1].max_tokens
        nxt = plan.next_prompt(prompt, output, t)
        assert nxt[: len(prompt)] == prompt
        assert nxt[len(prompt) : len(prompt) + len(output)] == output
        assert nxt[len(prompt) + len(output) :] == plan.appended_tokens(t)
        assert len(nxt) == lens[t]
        prompt = nxt


def test_agentic_tool_gaps_take_the_papers_share_of_session_time():
    spec = WorkloadSpec()
    shares = []
    for i in range(400):
        plan = plan_agentic(spec, i)
        assert plan.turns[-1].tool_gap_s == 0.0
        assert all(t.tool_gap_s > 0 for t in plan.turns[:-1])
        gen_s = sum(t.max_tokens for t in plan.turns) / spec.agentic.nominal_decode_tok_s
        gap_s = sum(t.tool_gap_s for t in plan.turns)
        shares.append(gap_s / (gap_s + gen_s))
    mean = sum(shares) / len(shares)
    assert 0.12 < mean < 0.18  # f ~ U(0.07, 0.23): mean share 0.15
    assert sorted(shares)[len(shares) // 2] == pytest.approx(0.15, abs=0.04)


def test_context_limit_bounds_every_request():
    spec = WorkloadSpec(max_context_tokens=48_000)  # scaled: 3,000 tokens
    limit = spec.scaled_max_context
    for i in range(200):
        for plan in plan_release(spec, list(RolloutClass)[i % 3], i):
            for prompt_len, turn in zip(plan.planned_prompt_lens(), plan.turns, strict=True):
                assert prompt_len + turn.max_tokens <= limit


def test_token_ids_stay_inside_the_vocabulary():
    spec = WorkloadSpec(vocab_size=50, min_token_id=3)
    plan = plan_agentic(spec, 0)
    ids = [i for t in range(len(plan.turns)) for i in plan.appended_tokens(t)]
    ids += plan.synthetic_output(0, 500)
    assert min(ids) >= 3 and max(ids) < 50
    assert len(set(ids)) == 47  # and the whole range is used


def test_synthetic_output_is_deterministic_per_session_and_turn():
    plan = plan_agentic(WorkloadSpec(), 0)
    assert plan.synthetic_output(1, 20) == plan.synthetic_output(1, 20)
    assert plan.synthetic_output(1, 20) != plan.synthetic_output(2, 20)


# --- determinism -------------------------------------------------------------------------


def draw_many(spec: WorkloadSpec, n: int = 40) -> list:
    workload = Workload(spec)
    return [plan for _ in range(n) for plan in workload.draw()]


def test_same_seed_same_plans_and_tokens():
    a, b = draw_many(WorkloadSpec(seed=11)), draw_many(WorkloadSpec(seed=11))
    assert a == b
    assert [p.initial_prompt() for p in a] == [p.initial_prompt() for p in b]


def test_different_seeds_differ():
    a, b = draw_many(WorkloadSpec(seed=1)), draw_many(WorkloadSpec(seed=2))
    assert [p.turns for p in a] != [p.turns for p in b]
    assert a[0].initial_prompt() != b[0].initial_prompt()
    assert not {p.session_id for p in a} & {p.session_id for p in b}


def test_plan_depends_on_index_not_draw_order():
    spec = WorkloadSpec(seed=5)
    drawn = draw_many(spec)
    agentic = [p for p in drawn if p.klass is AGENTIC]
    assert agentic[3] == plan_agentic(spec, 3)


def test_session_ids_are_unique():
    plans = draw_many(WorkloadSpec(), 300)
    assert len({p.session_id for p in plans}) == len(plans)


# --- mixture and phases ------------------------------------------------------------------


def test_drawn_units_track_the_target_mixture_within_one_group():
    spec = WorkloadSpec()
    target = spec.mixture_at(0)
    workload, counts = Workload(spec), Counter()
    for _ in range(400):
        for plan in workload.draw():
            counts[plan.klass] += 1
        n = sum(counts.values())
        for klass in RolloutClass:
            assert abs(counts[klass] - target[klass] * n) <= 16  # the largest group
    assert counts[AGENTIC] / n == pytest.approx(0.486 / 0.999, abs=0.01)


def test_drawer_picks_largest_deficit_and_skips_zero_shares():
    drawer = MixtureDrawer()
    target = normalise_mixture({RLVR: 1, RLHF: 1})
    picks = []
    for _ in range(4):
        klass = drawer.pick(target)
        drawer.record(klass, 1)
        picks.append(klass)
    assert AGENTIC not in picks
    assert Counter(picks) == {RLVR: 2, RLHF: 2}


def test_mix_shift_changes_the_released_classes_at_the_given_point():
    spec = mix_shift_spec(200, {RLHF: 100})
    workload = Workload(spec)
    before, after = Counter(), Counter()
    while workload.units_released < 400:
        at = workload.units_released
        for plan in workload.draw():
            (before if at < 200 else after)[plan.klass] += 1
    assert set(before) == set(RolloutClass)
    assert set(after) == {RLHF}
    assert spec.mixture_at(199)[AGENTIC] > 0.4 and spec.mixture_at(200)[RLHF] == 1.0


def test_length_drift_multiplier_is_piecewise_linear():
    spec = length_drift_spec(1000, growth=2.5)
    assert spec.output_multiplier(RLVR, 0) == 1.0
    assert spec.output_multiplier(RLHF, 500) == pytest.approx(1.75)
    assert spec.output_multiplier(RLHF, 5000) == 2.5
    assert spec.output_multiplier(AGENTIC, 1000) == 1.0  # not drifted by default


def test_length_drift_lengthens_the_same_draws():
    spec = length_drift_spec(1000, growth=2.5, length_scale=1.0)
    for i in range(20):
        early = plan_group(spec, RLHF, i, at=0)
        late = plan_group(spec, RLHF, i, at=1000)
        assert early[0].initial_prompt() == late[0].initial_prompt()
        for a, b in zip(early, late, strict=True):
            assert b.turns[0].max_tokens == pytest.approx(2.5 * a.turns[0].max_tokens, abs=2)


def test_seconds_axis_is_expressible():
    spec = mix_shift_spec(30.0, {RLVR: 1}, phase_axis="seconds")
    assert Workload(spec).draw(at=31.0)[0].klass is RLVR


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"mixture": {RLVR: -1, RLHF: 2}}, id="negative-share"),
        pytest.param({"mixture": {RLVR: 0}}, id="all-zero"),
        pytest.param({"group_size": {RLVR: 0}}, id="empty-group"),
        pytest.param({"min_token_id": 5000}, id="min-id-above-vocab"),
        pytest.param({"surprise": 1}, id="unknown-field"),
    ],
)
def test_invalid_specs_fail_at_construction(fields):
    with pytest.raises(ValidationError):
        WorkloadSpec(**fields)


def test_spec_round_trips_through_json():
    spec = length_drift_spec(100, seed=9, length_scale=0.5)
    assert WorkloadSpec.model_validate_json(spec.model_dump_json()) == spec
    assert math.isclose(sum(spec.mixture_at(0).values()), 1.0)
