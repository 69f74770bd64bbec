"""Live runs report the simulated engines' keep-up: `misat up`'s status line, `misat demo`'s table."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from misat_cli.demo import keep_up_cell, keep_up_line, summary_table
from misat_cli.up import keep_up_status


def reading(run: float | None, recent: float | None, *, low: bool = False) -> dict[str, Any]:
    return {"run": run, "recent": recent, "low": low, "busy": True}


def test_up_prints_nothing_before_the_engines_were_busy() -> None:
    assert keep_up_status([reading(None, None), None]) is None


def test_up_status_line_lists_each_engine() -> None:
    status = keep_up_status([reading(1.0, 0.996), reading(0.99, 0.981), None])
    assert status == ("keep-up (last 30 s busy): engine-0 0.996 engine-1 0.981 engine-2 -", False)


def test_up_warns_when_an_engine_is_under_0_95() -> None:
    status = keep_up_status([reading(1.0, 0.99), reading(0.9, 0.91, low=True)])
    assert status is not None
    line, warn = status
    assert warn and "engine-1 0.910" in line.split(";")[1] and "engine-0" not in line.split(";")[1]


def test_demo_reports_keep_up_per_engine_and_warns_under_0_95() -> None:
    readings = [reading(0.999, 0.99), reading(0.93, 0.9)]
    assert keep_up_cell(readings) == "0.999 [red]0.930[/]"
    line = keep_up_line("misa", readings)
    assert line is not None and line.startswith("misa: ") and "engine-1 0.930" in line
    assert keep_up_line("misa", [reading(0.999, 0.99)]) is None
    trainer = {"sample_rate_per_min": 1.0, "requests_per_min": 1.0, "decode_tokens_per_s": 1.0,
               "prefix_hit_rate": None, "mixture_tv_points": None, "units_completed": 1, "errors": 0}
    console = Console(width=200, record=True)
    console.print(summary_table([{"policy": "misa", "trainer": trainer, "keep_up": readings}]))
    text = console.export_text()
    assert "keep-up per engine" in text and "0.999 0.930" in text


def test_demo_warns_when_the_router_process_lags_in_modelled_time() -> None:
    from misat_cli.demo import LoopLag, loop_lag_line

    assert loop_lag_line("misa", None, 10.0) is None
    assert loop_lag_line("misa", {"mean_ms": 6.6, "p99_ms": 60.0}, 3.0) is None  # 0.02 modelled s
    line = loop_lag_line("misa", {"mean_ms": 58.0, "p99_ms": 200.0}, 10.0)
    assert line is not None and "0.58 modelled s" in line
    lag = LoopLag()
    assert lag.summary() is None
    lag.samples = [0.001] * 99 + [0.5]
    summary = lag.summary()
    assert summary is not None and summary["p99_ms"] == 500.0 and abs(summary["mean_ms"] - 5.99) < 1e-9
