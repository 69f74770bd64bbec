"""Live runs report the simulated engines' keep-up: `misat up`'s status line (the demo's: tests/bench)."""

from __future__ import annotations

from typing import Any

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
