"""Test support shared by the suites under ``tests/``.

- ``router_config``: the one ``RouterConfig`` builder (each suite passes its own arguments);
- ``fake_engine``: ``FakeEngine``, a configurable fake vLLM engine;
- ``processes``: free and taken ports, child processes started, awaited and stopped as the
  product does it (``misat_cli.processes``).

Import the modules by name (``from tests.support.fake_engine import FakeEngine``): pytest
puts the repo root on ``sys.path`` (``pythonpath`` in ``pyproject.toml``), so ``tests`` is a
namespace package under any ``--import-mode`` (the e2e run, ``-o addopts=''``, included).
"""
