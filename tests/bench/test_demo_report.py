"""The demo's report model: three rows, ratios to the tuned baseline, and every case of the verdict."""

from __future__ import annotations

import pytest
from rich.console import Console

from misat_bench.demo import render_table, warnings
from misat_bench.demo_report import (
    ONE_RUN_PARITY,
    DemoReport,
    Row,
    RowSpec,
    RunFigures,
    SeriesSample,
    build_report,
    table_rows,
    window_converged,
    window_counts,
)
from misat_bench.stats import mean_interval, t_quantile
from misat_sim.report import mixture_constrained_rate

TARGET = {"agentic": 48.6, "rlvr": 33.2, "rlhf": 18.2}


def run(rate: float, *, seed: int = 0, hit: float = 0.8, pre: int = 0, keep: float = 1.0,
        lag: float | None = None, cpu: float | None = 0.4) -> RunFigures:
    return RunFigures(seed=seed, window_s=400.0, mixture_rate_per_min=rate, units_per_min=rate * 1.1,
                      requests_per_min=rate * 3, prefix_hit_rate=hit, preemptions=pre, tv_points=1.0,
                      consumed_pct={"agentic": 48.0, "rlvr": 34.0, "rlhf": 18.0}, keep_up=[keep, 0.999],
                      errors=0, wall_s=40.0, trainer_lag_s=lag, router_cpu=cpu)


def rows(untuned: list[RunFigures], tuned: list[RunFigures], high: list[RunFigures]) -> list[Row]:
    return [
        Row(spec=RowSpec(role="untuned", label="misa-t router (misa, untuned)", router="misat", policy="misa",
                         ceiling=512), runs=untuned),
        Row(spec=RowSpec(role="tuned", label="vLLM Router cache_aware @ tuned 256", router="vllm-router",
                         policy="cache_aware", ceiling=256), runs=tuned),
        Row(spec=RowSpec(role="high", label="vLLM Router cache_aware @ high 512", router="vllm-router",
                         policy="cache_aware", ceiling=512), runs=high),
    ]


def report(untuned: list[RunFigures], tuned: list[RunFigures], high: list[RunFigures]) -> DemoReport:
    return build_report(rows(untuned, tuned, high), baseline="the vllm-router binary", tuning="cached",
                        target_pct=TARGET)


def test_mixture_constrained_rate_is_set_by_the_scarcest_class() -> None:
    # 60 agentic of a 50% share support 120 samples; 20 rlvr of 25% only 80: the batch waits for rlvr.
    rate = mixture_constrained_rate({"agentic": 50, "rlvr": 25, "rlhf": 25}, {"agentic": 60, "rlvr": 20,
                                                                               "rlhf": 40}, minutes=2.0)
    assert rate == pytest.approx(40.0)
    assert mixture_constrained_rate({"a": 1.0}, {}, minutes=1.0) == 0.0
    assert mixture_constrained_rate({}, {"a": 3}, minutes=1.0) is None
    assert mixture_constrained_rate({"a": 1.0}, {"a": 3}, minutes=0.0) is None


def test_interval_is_students_t_and_one_value_has_none() -> None:
    one = mean_interval([1.2])
    assert (one.low, one.high, one.n) == (1.2, 1.2, 1) and "one run" in one.describe()
    iv = mean_interval([1.0, 1.1, 1.2])
    half = t_quantile(2) * (0.01 / 3) ** 0.5
    assert iv.mean == pytest.approx(1.1) and iv.high - iv.mean == pytest.approx(half)
    assert t_quantile(2) == pytest.approx(4.303) and t_quantile(100) == pytest.approx(1.96)
    with pytest.raises(ValueError):
        mean_interval([])


def test_ratios_are_paired_by_repeat_and_the_tuned_row_is_one() -> None:
    r = report([run(110, seed=0), run(100, seed=1)], [run(100, seed=0), run(80, seed=1)],
               [run(50, seed=0), run(40, seed=1)])
    assert r.ratios["tuned"].interval is not None and r.ratios["tuned"].interval.mean == pytest.approx(1.0)
    untuned = r.ratios["untuned"].interval
    assert untuned is not None and untuned.mean == pytest.approx((1.1 + 1.25) / 2) and untuned.n == 2
    cells = table_rows(r)
    assert [c[0] for c in cells[1:]] == ["untuned", "tuned", "high"]
    assert cells[0][3] == "mixture-constrained samples/min" and cells[1][3] == "105.0"


def test_verdict_win_names_what_ran_and_the_margin() -> None:
    r = report([run(120, seed=0), run(118, seed=1), run(121, seed=2)],
               [run(100, seed=0), run(99, seed=1), run(101, seed=2)],
               [run(60, hit=0.05, pre=300, seed=k) for k in range(3)])
    assert r.ratios["untuned"].reading == "win"
    assert r.verdict[0].startswith("misa-t router (misa, untuned) beat vLLM Router cache_aware @ tuned 256")
    assert "1.20x" in r.verdict[0]
    assert "prefix hit falls to 5.0% with 300 preemptions" in r.verdict[1]


def test_verdict_parity_when_the_interval_straddles_one() -> None:
    r = report([run(104, seed=0), run(96, seed=1)], [run(100, seed=0), run(100, seed=1)],
               [run(95, hit=0.75, seed=k) for k in range(2)])
    assert r.ratios["untuned"].reading == "parity"
    assert "matched" in r.verdict[0] and "needs no one to find it" in r.verdict[0]
    # The high row lost no hits: a wrong limit costs little here, and the verdict says so.
    assert "costs little" in r.verdict[1]


def test_one_run_reads_parity_within_the_stated_band_only() -> None:
    inside = report([run(100 * (1 + ONE_RUN_PARITY / 2))], [run(100)], [run(90)])
    assert inside.ratios["untuned"].reading == "parity"
    outside = report([run(100 * (1 - 2 * ONE_RUN_PARITY))], [run(100)], [run(90)])
    assert outside.ratios["untuned"].reading == "loss"


def test_verdict_says_so_when_this_router_loses() -> None:
    r = report([run(79)], [run(100)], [run(73, hit=0.003, pre=191)])
    assert r.ratios["untuned"].reading == "loss"
    assert r.verdict[0].startswith("misa-t router (misa, untuned) lost to vLLM Router cache_aware @ tuned 256")
    assert "0.79x" in r.verdict[0]


def test_engines_that_fell_behind_give_no_verdict() -> None:
    r = report([run(150, keep=0.85)], [run(100)], [run(90)])
    assert len(r.verdict) == 1 and r.verdict[0].startswith("Not a comparison")
    assert "misa-t router (misa, untuned)" in r.verdict[0]


def test_a_cpu_bound_router_process_gives_no_verdict_but_the_binary_is_not_judged() -> None:
    r = report([run(80, cpu=0.97)], [run(100)], [run(90)])
    assert r.verdict[0].startswith("Not a comparison") and "CPU-bound" in r.verdict[0]
    assert any("used 0.97 of a core" in w for w in warnings(r, time_scale=6.0))
    # The baseline rows run the multi-threaded binary: its CPU is shown, not judged.
    assert report([run(100)], [run(100, cpu=1.6)], [run(90, cpu=1.2)]).ratios["untuned"].reading == "parity"


def test_a_row_without_samples_gives_no_ratio() -> None:
    r = report([run(100)], [run(0)], [run(90)])
    assert r.ratios["untuned"].interval is None and r.verdict[0].startswith("No verdict")


def test_table_and_warnings_show_keep_up_and_a_lagging_trainer() -> None:
    r = report([run(100, keep=0.93)], [run(100)], [run(90, lag=0.02)])
    lines = warnings(r, time_scale=10.0)
    assert any("misa-t router" in w and "engine-0 0.930" in w for w in lines)
    assert any("@ high 512" in w and "0.20 modelled s" in w for w in lines)
    console = Console(width=250, record=True)
    console.print(render_table(r))
    text = console.export_text()
    assert "0.930" in text and "ratio to tuned" in text and "1.00x (one run)" in text


def test_the_sweep_is_refined_around_its_best_point_to_the_step() -> None:
    from misat_bench.suite import refine_ceilings

    sweep = {64: 108.0, 96: 124.0, 128: 104.0}
    assert refine_ceilings(sweep, step=8) == [80, 112]
    sweep |= {80: 120.0, 112: 126.0}  # the best moves to 112: bisect 96..112 and 112..128
    assert refine_ceilings(sweep, step=8) == [104, 120]
    sweep |= {104: 125.0, 120: 125.5}
    assert refine_ceilings(sweep, step=8) == []  # both gaps are 8
    # A best point at an end of the grid is not bracketed: the sweep goes past it first.
    assert refine_ceilings({64: 3.0, 96: 2.0, 128: 1.0}, step=8) == [32, 80]
    assert refine_ceilings({64: 3.0, 96: 2.0, 32: 2.5}, step=8) == [48, 80]
    assert refine_ceilings({8: 3.0, 16: 2.0}, step=8) == []  # the lowest is the step: as low as it goes
    assert refine_ceilings({64: 1.0, 96: 2.0}, step=8) == [192, 80]


def test_verdict_explains_more_units_but_off_the_mixture() -> None:
    off = run(90).model_copy(update={"units_per_min": 130.0, "tv_points": 9.9,
                                     "consumed_pct": {"agentic": 57.0, "rlvr": 23.0, "rlhf": 20.0}})
    r = report([off], [run(100)], [run(45, hit=0.001, pre=250)])
    assert r.ratios["untuned"].reading == "loss"
    assert r.verdict[1] == ("It completed 1.18x the baseline's units per minute, but off the trainer's mixture "
                            "(TV 9.9 points; rlvr 23% of completions against a 33% target), and a trainer that "
                            "fills batches at its mixture waits for the scarcest class.")
    # On the mixture: no such sentence.
    assert not any("off the trainer's mixture" in v for v in report([run(100)], [run(100)], [run(90)]).verdict)


def test_a_tuned_once_row_is_judged_against_this_fleets_tuned_row_and_this_router_against_it() -> None:
    once = Row(spec=RowSpec(role="tuned-once", label="vLLM Router cache_aware @ tuned-once 96",
                            router="vllm-router", policy="cache_aware", ceiling=96),
               runs=[run(70, hit=0.3, pre=40, seed=k) for k in range(2)])
    r = build_report([*rows([run(98, seed=0), run(102, seed=1)], [run(100, seed=0), run(100, seed=1)],
                            [run(60, seed=k) for k in range(2)]), once],
                     baseline="the vllm-router binary", tuning="cached", target_pct=TARGET)
    assert r.ratios["tuned-once"].interval is not None and r.ratios["tuned-once"].interval.mean == pytest.approx(0.7)
    against = r.ratios["untuned/tuned-once"]
    assert against.interval is not None and against.interval.mean == pytest.approx(1.0 / 0.7)
    assert against.reading == "win"
    assert r.verdict[-1].startswith("The limit tuned for the standard fleet and left unchanged "
                                    "(vLLM Router cache_aware @ tuned-once 96) gets 0.70x")
    assert "1.43x" in r.verdict[-1] and "(win)" in r.verdict[-1]
    assert [c[0] for c in table_rows(r)[1:]] == ["untuned", "tuned", "high", "tuned-once"]
    # Without the row: no such ratio and no such sentence.
    plain = report([run(100)], [run(100)], [run(90)])
    assert "untuned/tuned-once" not in plain.ratios and not any("left unchanged" in v for v in plain.verdict)


def _series(per_window: list[dict[str, int]], window_s: float = 60.0, step_s: float = 6.0) -> list[SeriesSample]:
    """Samples every ``step_s`` whose per-class completions grow evenly within each window."""
    out, total, t = [], dict.fromkeys(per_window[0], 0), 0.0
    for counts in per_window:
        for i in range(int(window_s / step_s)):
            done = {c: total[c] + counts[c] * i * step_s // window_s for c in counts}
            out.append(SeriesSample(t_s=t, units=sum(done.values()), units_by_class=done, prompt_tokens=0,
                                    cached_tokens=0))
            t += step_s
        total = {c: total[c] + counts[c] for c in counts}
    out.append(SeriesSample(t_s=t, units=sum(total.values()), units_by_class=total, prompt_tokens=0, cached_tokens=0))
    return out


def test_a_measured_window_converges_when_the_late_half_agrees_with_the_early_half() -> None:
    steady = _series([{"agentic": 200, "rlvr": 100}] * 6)
    assert window_counts(steady, 0.0, 60.0) == [{"agentic": 200, "rlvr": 100}] * 6
    assert window_converged(steady, 360.0) is True
    # RLVR still climbing in the measured window (a start-up transient): 40 -> 160 per window.
    rising = _series([{"agentic": 200, "rlvr": 40 + 24 * k} for k in range(6)])
    assert window_converged(rising, 360.0) is False
    assert window_converged([], 360.0) is None
    # Too short a window for the rule's windows: not converged (the rule wants four).
    assert window_converged(steady, 120.0) is False


def test_a_run_that_did_not_converge_is_warned_about() -> None:
    r = report([run(100).model_copy(update={"converged": False})], [run(100)], [run(90)])
    assert any("did not converge" in w and "misa-t router" in w for w in warnings(r, time_scale=6.0))
    assert not any("did not converge" in w for w in warnings(report([run(100)], [run(100)], [run(90)]), 6.0))
