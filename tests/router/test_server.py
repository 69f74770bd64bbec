"""``misat router`` entry point: clean errors and exit codes, no tracebacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from misat_router.server import main
from tests.support.processes import taken_port
from tests.support.router_config import router_config


def test_bad_config_exits_non_zero_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "router.yaml"
    bad.write_text("model: m\nengines: {urls: []}\n")
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err
    assert not any("/router/" in tb for tb in err.split("Traceback")[1:]), err


def test_taken_port_exits_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "router.json"
    cfg.write_text(router_config(["http://127.0.0.1:9"]).model_dump_json())
    with taken_port() as port:
        assert main(["--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert "cannot listen" in err
    # No traceback from the router (a stray one from another test's garbage-collected HTTP
    # client can land in the same capture, so look at where each traceback comes from).
    assert not any("/router/" in tb for tb in err.split("Traceback")[1:]), err


def test_missing_token_file_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "router.json"
    cfg.write_text(router_config(["http://127.0.0.1:9"]).model_dump_json())
    assert main(["--config", str(cfg), "--admin-token-file", str(tmp_path / "nope")]) == 2
