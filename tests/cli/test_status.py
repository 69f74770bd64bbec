"""`misat status` renders a live router's `/status` as tables; `misat up` shows how to use the admin API."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from openai import AsyncOpenAI
from rich.console import Console

from misat_cli.localpool import local_pool
from misat_cli.status import engines_table, fetch_status, main, render_status
from misat_cli.up import admin_token_lines
from tests.support.manifests import one_engine_manifest


async def test_status_of_a_live_router_reads_in_the_manifests_units(tmp_path: Path) -> None:
    # misa-t: the policy with class budgets, whose reasons the table shows
    async with local_pool(one_engine_manifest(tmp_path, policy="misa-t"), time_scale=200.0) as pool:
        client = AsyncOpenAI(base_url=f"{pool.router_url}/v1", api_key="unused",
                             default_headers={"X-Rollout-Class": "rlhf"})
        await client.completions.create(model=pool.spec.model.served, prompt=[5, 6, 7, 8], max_tokens=4)
        await client.close()
        status = await fetch_status(pool.router_url)
    console = Console(width=250, record=True)
    console.print(render_status(status))
    text = console.export_text()
    # Shares as percent, as the manifest writes them (48.6, not 0.486).
    assert "48.6%" in text and "33.2%" in text and "18.2%" in text
    assert "policy misa-t" in text and "engines healthy 1/1" in text
    assert "KV budget (est. tokens)" in text and "KV in use" in text
    assert pool.engine_urls[0] in text
    # Each class's budget and cap come with the reason they have that value.
    reasons = [row["reason"] for row in status["kv"]]
    assert reasons and all("of the engine's KV budget" in r and "cap = " in r for r in reasons)
    assert "why this budget and cap" in text


def test_status_of_an_unreachable_router_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("misat status: cannot read http://127.0.0.1:9/status") and "Traceback" not in err


def test_admin_token_is_printed_or_written_owner_only(tmp_path: Path) -> None:
    printed = admin_token_lines("http://127.0.0.1:8080", "s3cret", None)
    assert printed[0] == "Admin token: s3cret" and "Bearer s3cret" in printed[1]
    assert "http://127.0.0.1:8080/admin/pause" in printed[1]
    path = tmp_path / "state" / "token"
    lines = admin_token_lines("http://127.0.0.1:8080", "s3cret", path)
    assert path.read_text() == "s3cret\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "s3cret" not in " ".join(lines) and str(path) in lines[0]


def test_an_engine_being_handed_back_reads_so_in_the_engines_table() -> None:
    rows = [{"id": "http://e0", "healthy": True, "draining": False, "handing_back": False},
            {"id": "http://e1", "healthy": True, "draining": False, "handing_back": True}]
    console = Console(width=250, record=True)
    console.print(engines_table({"engines": rows}))
    lines = {line.split()[1]: line for line in console.export_text().splitlines() if "http://e" in line}
    assert "handing back" in lines["http://e1"] and "handing back" not in lines["http://e0"]


def test_a_held_engine_says_why_in_the_engines_table_and_the_column_is_absent_otherwise() -> None:
    reason = "restarted: it serves the weights it loaded at start, not weight version 'v7'"
    rows = [{"id": "http://e0", "healthy": True, "held": None},
            {"id": "http://e1", "healthy": True, "held": reason}]
    console = Console(width=400, record=True)
    console.print(engines_table({"engines": rows}))
    text = console.export_text()
    lines = {line.split()[1]: line for line in text.splitlines() if "http://e" in line}
    assert "held (no new work)" in text and "'v7'" in lines["http://e1"] and "restarted" not in lines["http://e0"]
    console = Console(width=400, record=True)
    console.print(engines_table({"engines": [rows[0]]}))
    assert "held" not in console.export_text()


def test_a_keep_pause_shows_in_the_summary_and_the_frozen_engines_in_the_engines_table() -> None:
    rows = [{"id": "http://e0", "healthy": True, "frozen": True},
            {"id": "http://e1", "healthy": True, "frozen": False}]
    console = Console(width=300, record=True)
    console.print(engines_table({"engines": rows}))
    text = console.export_text()
    lines = {line.split()[1]: line for line in text.splitlines() if "http://e" in line}
    assert "frozen (keep pause)" in text
    assert lines["http://e0"].rstrip(" │").endswith("yes") and lines["http://e1"].rstrip(" │").endswith("no")
    console = Console(width=300, record=True)
    console.print(engines_table({"engines": [rows[1]]}))
    assert "frozen" not in console.export_text()
    console = Console(width=300, record=True)
    console.print(render_status({"paused": True, "pause_mode": "keep", "engines": rows}))
    assert "paused (keep)" in console.export_text()
