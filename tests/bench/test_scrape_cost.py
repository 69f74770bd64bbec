"""The scrape-cost benchmark's summary: CPU per scrape served, keeping up, engines per core."""

from __future__ import annotations

import pytest

from misat_bench.scrape_cost import Run, ScrapeCostSettings, markdown, summarise


def run(router: str, engines: int, rnd: int, cores: float, scrapes: float) -> Run:
    return Run(router=router, engines=engines, round=rnd, cpu_cores=cores, scrapes_per_s=scrapes,
               configured_scrapes_per_s=engines * 4.0)


def test_cost_per_scrape_counts_the_scrapes_served_and_a_router_behind_is_flagged() -> None:
    runs = [run("new", 32, 0, 0.064, 128.0), run("new", 32, 1, 0.060, 126.0),
            run("old", 32, 0, 0.60, 53.0), run("old", 32, 1, 0.58, 52.0)]
    new, old = summarise(runs)
    assert new.kept_up and not old.kept_up
    assert new.cpu_ms_per_scrape == pytest.approx(1000 * (0.064 / 128 + 0.060 / 126) / 2)
    # Engines one core could scrape four times a second at that cost, whether or not the run kept up.
    assert new.engines_per_core == pytest.approx(1 / (new.cpu_ms_per_scrape / 1000 * 4))
    assert old.engines_per_core == pytest.approx(1 / (old.cpu_ms_per_scrape / 1000 * 4))
    assert old.cpu_ms_per_engine_s == pytest.approx(1000 * 0.59 / 32)
    table = markdown([new, old], ScrapeCostSettings())
    assert "(behind)" in table.splitlines()[3] and "(behind)" not in table.splitlines()[2]
