"""Shared builders for the simulator tests: small engines with explicit limits."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from misat_sim.config import SimEngineConfig
from misat_sim.engine import SimEngine
from misat_sim.server import RunningServer, start_server

SERVED_MODEL = "sim-tiny"
"""The model name the HTTP tests' simulated server serves."""


def tiny_engine(**overrides: object) -> SimEngine:
    """A tiny-cpu engine with block size 4 unless overridden (small numbers keep tests readable)."""
    fields: dict[str, object] = {
        "profile": "tiny-cpu",
        "block_size": 4,
        "num_gpu_blocks": 65,
        "max_model_len": 256,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 64,
    }
    fields.update(overrides)
    return SimEngine(SimEngineConfig.model_validate(fields))


def run_to_completion(engine: SimEngine, *, use_advance: bool = False, limit: int = 100_000) -> list:
    """Step until idle; returns every FinishedRequest in finish order."""
    finished = []
    t = 0.0
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return finished
        r = engine.advance(t, float("inf")) if use_advance else engine.step(t)
        finished.extend(r.finished)
        t = r.end
    raise AssertionError("engine did not drain")


@pytest.fixture
def engine() -> SimEngine:
    return tiny_engine()


@pytest.fixture
def make_engine():
    """Factory of small engines (``tiny_engine``)."""
    return tiny_engine


@pytest.fixture
def drain():
    """``run_to_completion`` as a fixture."""
    return run_to_completion


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    """A tiny-cpu simulated vLLM server at x2000 on a loopback port."""
    cfg = SimEngineConfig(profile="tiny-cpu", served_model_name=SERVED_MODEL, time_scale=2000.0, seed=3)
    srv = await start_server(cfg)
    yield srv
    await srv.stop()


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()  # an unclosed client's transport is finalised later, in another test
