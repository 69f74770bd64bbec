"""The HTTP layer's keep-up: measured over the window, and runs from lagging engines marked."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console

from misat_bench.http_layer import KEEP_UP_COMPARABLE, HttpRun, WindowKeepUp, http_rows
from misat_bench.report import NOT_A_COMPARISON, SummaryRow, render_table


def run(name: str, rate: float, keep_up: list[float]) -> HttpRun:
    return HttpRun(name=name, router="misat" if name.startswith("misat") else "vllm-router", policy="cache-aware",
                   ceiling=96, sample_rate_per_min=rate, prefix_hit_rate=0.9, tv_points=1.0, preemptions=0,
                   units_completed=10, errors=0, retries=0, missing_token_ids=0, keep_up=keep_up,
                   comparison=min(keep_up) >= KEEP_UP_COMPARABLE, wall_s=1.0)


def rendered(rows: list[SummaryRow]) -> str:
    console = Console(width=250, record=True)
    console.print(render_table([], rows))
    return console.export_text()


def test_rows_from_engines_under_0_9_are_not_a_comparison() -> None:
    rows = http_rows([run("vllm-router@tuned", 100.0, [0.99, 0.97]), run("misat-t@high", 120.0, [0.95, 0.85])])
    assert [(r.comparison, r.keep_up) for r in rows] == [(True, 0.97), (False, 0.85)]
    assert rows[1].note == NOT_A_COMPARISON and rows[0].note == ""
    text = rendered(rows)
    assert "keep-up" in text and "0.850" in text and "0.970" in text
    line = next(ln for ln in text.splitlines() if "misat" in ln)
    assert NOT_A_COMPARISON in line and "1.20" not in line  # the ratio is not shown as one
    assert "1.00" in next(ln for ln in text.splitlines() if "vllm-router" in ln)
    # The JSON says so too.
    assert rows[1].model_dump()["comparison"] is False


def test_a_lagging_reference_makes_every_ratio_not_a_comparison() -> None:
    rows = http_rows([run("vllm-router@tuned", 100.0, [0.8, 0.97]), run("misat-t@high", 120.0, [1.0, 1.0])])
    assert [r.comparison for r in rows] == [False, False]


@dataclass
class Reading:
    advanced_s: float
    busy_s: float


class StubLoop:
    def __init__(self) -> None:
        self.advanced_s = self.busy_s = 0.0

    def keep_up(self) -> Reading:
        return Reading(self.advanced_s, self.busy_s)


def test_window_keep_up_leaves_the_warm_up_out() -> None:
    a, b = StubLoop(), StubLoop()
    window = WindowKeepUp([a, b])  # type: ignore[list-item]
    a.advanced_s, a.busy_s = 10.0, 40.0  # warm-up: far behind
    window.mark()
    a.advanced_s, a.busy_s = 10.0 + 95.0, 40.0 + 100.0
    assert window.ratios() == [0.95, 1.0]  # b was never busy
    assert window.advanced_s() == [95.0, 0.0]
