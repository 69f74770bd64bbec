"""Every ``misat`` subcommand answers ``--help`` (its module imports and its parser builds)."""

from __future__ import annotations

import pytest

from misat_cli.main import SUBCOMMANDS, main


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_subcommand_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:"), out[:200]


def test_top_level_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in SUBCOMMANDS:
        assert command in out


def test_unknown_subcommand_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err


def test_a_missing_extra_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise ModuleNotFoundError("No module named 'rich'", name="rich")

    monkeypatch.setattr("misat_cli.main.importlib.import_module", missing)
    with pytest.raises(SystemExit) as exc:
        main(["demo"])
    assert str(exc.value) == "misat demo: the Python package 'rich' is missing; install it with pip install 'misa-t[cli]'"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"misat {version('misa-t')}"


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_flag_is_described_with_its_default(command: str) -> None:
    import argparse
    import importlib

    parser = importlib.import_module(SUBCOMMANDS[command].module).build_parser()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        assert action.help, f"misat {command} {action.option_strings[0]} has no help"
        shows_default = "default" in action.help.lower() or issubclass(
            parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
        if action.default not in (None, False, argparse.SUPPRESS):
            assert shows_default, f"misat {command} {action.option_strings[0]}: help does not give its default"
