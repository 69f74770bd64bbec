"""n > 1 and batched prompts: one placement, counted as its samples (load, session places,
footprint per sample, completed units); logprobs and the sampling fields pass through the
router untouched (the official openai client against simulated engines)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from misat_router.app import create_app
from misat_router.policy.misa import MisaPolicy
from misat_router.policy.runner import PolicyRunner
from misat_router.policy.settings import (
    ClassSpec,
    FootprintSettings,
    PolicyName,
    PolicySettings,
    PrefixIndexSettings,
    ResidencySettings,
    SessionAdmissionSettings,
    WorkloadMix,
)
from misat_router.policy.types import Completion, EngineSnapshot, RequestMeta
from misat_router.request_meta import EndpointKind, parse_request
from misat_router.service import start_service
from misat_router.state import STATE, RouterState
from misat_sim.server import RunningServer
from tests.support.router_config import MODEL, router_config

from .conftest import WAIT_S

RLVR = {"X-Rollout-Class": "rlvr"}


def _runner() -> PolicyRunner:
    mix = WorkloadMix(classes=(ClassSpec(name="rlvr", share=50), ClassSpec(name="agentic", share=50,
                                                                             multi_turn=True)))
    settings = PolicySettings(
        name=PolicyName.MISA_T, kv_budget_fraction=1.0,
        footprint=FootprintSettings(min_samples=1, bootstrap_tokens=1000),
        residency=ResidencySettings(min_samples=1),
        admission=SessionAdmissionSettings(max_sessions_per_engine=6),
    )
    return PolicyRunner(MisaPolicy(settings, mix), mix)


def _engines(capacity: int = 100_000) -> dict[str, EngineSnapshot]:
    return {"e0": EngineSnapshot(engine_id="e0", kv_capacity_tokens=capacity)}


def _group(rid: str, samples: int) -> RequestMeta:
    return RequestMeta(request_id=rid, workload_class="rlvr", prompt_token_ids=tuple(range(100)),
                       prompt_tokens=100, samples=samples)


def test_a_group_counts_as_its_samples_and_drains_to_zero() -> None:
    runner = _runner()
    policy = runner.policy
    assert isinstance(policy, MisaPolicy)
    group = _group("g", 4)
    d = runner.submit(group, _engines(), 0.0)
    assert d.placed and d.engine_id == "e0"
    assert policy.load.get("e0") == 4  # vLLM reports 4 running requests for it
    assert policy.engine_sessions["e0"] == 4 and policy.class_sessions["rlvr"] == 4
    # Usage: the prompt once, the four outputs summed.
    runner.finish(group, "e0", Completion(prompt_tokens=100, completion_tokens=4 * 50), 2.0)
    assert runner.mixture.completed["rlvr"] == 4
    assert policy.footprint["rlvr"].value() == pytest.approx((100 + 200) / 4)  # per sample
    assert policy.load.get("e0") == 0 and policy.engine_sessions["e0"] == 0
    assert policy.class_sessions["rlvr"] == 0 and not runner.sessions


def test_a_group_takes_as_many_places_as_samples() -> None:
    runner = _runner()  # at most 6 places per engine
    first = _group("a", 4)
    assert runner.submit(first, _engines(), 0.0).placed
    second = _group("b", 4)
    assert not runner.submit(second, _engines(), 0.0).placed  # 4 + 4 > 6: held
    assert runner.held_count("rlvr") == 1
    runner.finish(first, "e0", Completion(prompt_tokens=100, completion_tokens=40), 1.0)
    placed = runner.release(_engines(), 1.0)
    assert [r.request_id for r, _ in placed] == ["b"]
    # A group larger than the cap still runs alone on an idle engine.
    runner.finish(second, "e0", Completion(prompt_tokens=100, completion_tokens=40), 2.0)
    assert runner.submit(_group("big", 9), _engines(), 3.0).placed


@pytest.mark.parametrize(
    ("body", "samples"),
    [
        ({"prompt": [1, 2], "n": 4}, 4),
        ({"prompt": [[1, 2], [3]], "n": 2}, 4),
        ({"prompt": ["a b", "c", "d"]}, 3),
        ({"prompt": "abc"}, 1),
    ],
)
def test_samples_are_n_times_the_prompts(body: dict, samples: int) -> None:
    mix = WorkloadMix(classes=(ClassSpec(name="rlvr", share=100),), default_class="rlvr")
    parsed = parse_request(json.dumps({"model": "m", **body}).encode(), {}, EndpointKind.COMPLETIONS,
                           mix=mix, prefix=PrefixIndexSettings(), request_id="r")
    assert parsed.meta.samples == samples


# ---- through the router, simulated engines ------------------------------------------------


@pytest.fixture
async def sim_engines(make_sims) -> list[RunningServer]:  # type: ignore[no-untyped-def]
    return list(await make_sims(2, time_scale=2000.0))


@pytest.fixture
async def sim_router(sim_engines: list[RunningServer]) -> AsyncIterator[tuple[RouterState, str]]:
    cfg = router_config([s.base_url for s in sim_engines], policy="misa-t")
    server = await start_service(create_app(cfg, admin_token="t"))
    state = server.app[STATE]
    await state.wait_until(lambda: state.registry.healthy_count() == 2, WAIT_S)
    yield state, server.url
    await server.stop()


@pytest.fixture
async def client(sim_router: tuple[RouterState, str]) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=sim_router[1] + "/v1", api_key="unused", max_retries=0,
                           default_headers=RLVR)
    yield c
    await c.close()


async def test_n_through_the_router_counts_units_and_drains(sim_router, client) -> None:
    state, url = sim_router
    r = await client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], n=3, max_tokens=4,
                                        extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 12
    batched = await client.completions.create(model=MODEL, prompt=[[5, 6], [7, 8, 9]], n=2, max_tokens=2,
                                              extra_body={"ignore_eos": True})
    assert [c.index for c in batched.choices] == [0, 1, 2, 3]
    async with aiohttp.ClientSession() as http, http.get(url + "/status") as resp:
        status = await resp.json()
    rlvr = next(c for c in status["classes"] if c["name"] == "rlvr")
    assert rlvr["completed_units"] == 7 and rlvr["active_sessions"] == 0 and rlvr["held_requests"] == 0
    assert status["requests_in_flight"] == 0
    assert state.runner.policy.load.total == 0


async def test_logprobs_pass_through_the_router(client) -> None:
    r = await client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=4, logprobs=2, seed=3,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, "top_k": 20,
                    "stop_token_ids": [2], "return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.logprobs is not None
    assert [int(t.split(":")[1]) for t in choice.logprobs.tokens] == choice.model_dump()["token_ids"]
    assert all(v <= 0 for v in choice.logprobs.token_logprobs)
    assert all(2 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t5"}],
                                                max_tokens=3, logprobs=True, top_logprobs=2,
                                                extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    stream = await client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=3, logprobs=1,
                                             stream=True, extra_body={"ignore_eos": True})
    streamed = [lp for chunk in [c async for c in stream] for ch in chunk.choices if ch.logprobs
                for lp in ch.logprobs.token_logprobs]
    assert len(streamed) == 3


async def test_a_refused_parameter_reaches_the_client_unchanged(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=MODEL, prompt=[5], max_tokens=2,
                                        extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=MODEL, prompt=[5], max_tokens=2, n=0)
    assert info.value.body["param"] == "n"  # type: ignore[index]
