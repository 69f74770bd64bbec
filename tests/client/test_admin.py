"""The admin helper against a live router and simulated engines: pause (wait, abort), resume with
a prefix-cache reset and a weight version, engine fan-out, the pass-through call, the whole
weight-update sequence, and the router's refusals as typed errors."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from misat_client import (
    AdminClient,
    AsyncRolloutSession,
    EngineCall,
    EngineOp,
    PauseMode,
    RouterHTTPError,
    SyncAdminClient,
    WeightUpdateFailed,
)
from misat_sim.server import STATE as SIM_STATE

from .conftest import TOKEN, PoolFactory

LONG = 1000
"""Tokens of a generation that is still running when the test pauses (seconds at time scale 1)."""


async def test_pause_wait_then_resume_with_a_version(sim_pool: PoolFactory) -> None:
    pool = await sim_pool()
    async with AdminClient(pool.url, TOKEN) as admin:
        paused = await admin.pause(PauseMode.WAIT, reset_prefix_cache=False)
        assert paused.paused and paused.mode == "wait" and paused.aborted_requests == 0
        assert paused.prefix_cache_reset is None
        status = await admin.status()
        assert status.paused and status.pause_mode == "wait"
        resumed = await admin.resume(reset_prefix_cache=True, weight_version="v7")
        assert not resumed.paused and resumed.weight_version == "v7"
        assert resumed.prefix_cache_reset == dict.fromkeys(pool.engine_urls, "ok") and not resumed.reset_failures()
        status = await admin.status()
        assert not status.paused and status.weight_versions() == dict.fromkeys(pool.engine_urls, "v7")


async def test_pause_abort_answers_the_request_in_flight_with_its_partial_output(sim_pool: PoolFactory) -> None:
    pool = await sim_pool(time_scale=1.0)
    client = openai.AsyncOpenAI(base_url=pool.url + "/v1", api_key="unused")
    async with AsyncRolloutSession(pool.url, "agentic") as s, AdminClient(pool.url, TOKEN) as admin:
        rollout = asyncio.create_task(s.create(
            s.openai(client).completions.create, model=pool.model, prompt=list(range(5, 50)), max_tokens=LONG,
            extra_body={"ignore_eos": True, "return_token_ids": True}))
        await pool.wait(lambda: len(pool.state.dispatcher.in_flight) == 1)
        paused = await admin.pause(PauseMode.ABORT)
        answer = await rollout
        assert paused.mode == "abort" and paused.aborted_requests == 1
        choice = answer.choices[0]
        assert choice.finish_reason == "abort"
        assert answer.usage is not None and answer.usage.completion_tokens < LONG
        await pool.wait(lambda: not pool.state.dispatcher.in_flight)
        await admin.resume()
    await client.close()
    await pool.wait(lambda: pool.live_sessions("agentic") == 0)


async def test_engine_fan_out_and_pass_through(sim_pool: PoolFactory) -> None:
    pool = await sim_pool()
    async with AdminClient(pool.url, TOKEN) as admin:
        slept = await admin.engines(EngineOp.SLEEP, {"level": "1"})
        assert slept.op == "sleep" and slept.ok and set(slept.engines) == set(pool.engine_urls)
        woke = await admin.engines(EngineOp.WAKE_UP)
        assert woke.ok
        reset = await admin.engines(EngineOp.RESET_PREFIX_CACHE)
        assert reset.ok
        call = await admin.engine_call(EngineCall("/update_weight_version", {"new_version": "v2"}),
                                       weight_version="v2")
        assert call.ok and {r.status for r in call.engines.values()} == {200}
        assert all(r.body["new_version"] == "v2" for r in call.engines.values())
        assert (await admin.status()).weight_versions() == dict.fromkeys(pool.engine_urls, "v2")
        unknown = await admin.engine_call(EngineCall("/no_such_control"))
        assert not unknown.ok and set(unknown.failed()) == set(pool.engine_urls)


async def test_the_weight_update_sequence(sim_pool: PoolFactory) -> None:
    pool = await sim_pool()
    async with AdminClient(pool.url, TOKEN) as admin:
        done = await admin.update_weights([EngineCall("/areal_update_weights", {"model_path": "/ckpt/9"})],
                                          version="9")
        assert done.pause.paused and done.pause.mode == "abort"
        assert done.calls[0].ok and not done.resume.paused and done.resume.weight_version == "9"
        assert done.resume.prefix_cache_reset == dict.fromkeys(pool.engine_urls, "ok")
        with pytest.raises(WeightUpdateFailed, match="stays paused"):
            await admin.update_weights([EngineCall("/areal_update_weights", {})], version="10")
        assert (await admin.status()).paused  # no rollout runs on a pool of mixed weights
        await admin.resume()


async def test_the_weight_update_sequence_with_a_keep_pause(sim_pool: PoolFactory) -> None:
    # A router that resets caches on every pause by default: the keep pause must not ask it to.
    pool = await sim_pool(time_scale=1.0, pause_resets_prefix_cache=True)
    async with AdminClient(pool.url, TOKEN) as admin, aiohttp.ClientSession() as http:
        gen = asyncio.create_task(http.post(pool.url + "/v1/completions", headers={"X-Rollout-Class": "rlvr"},
                                            json={"model": pool.model, "prompt": [5, 6, 7], "max_tokens": 400,
                                                  "ignore_eos": True}))
        await pool.wait(lambda: len(pool.state.dispatcher.in_flight) == 1)
        (engine,) = {f.engine_id for f in pool.state.dispatcher.in_flight.values()}
        done = await admin.update_weights([EngineCall("/update_weight_version", {"new_version": "9"})],
                                          version="9", mode=PauseMode.KEEP)
        # Frozen, not waited for: the update ran with the request still in flight.
        assert done.pause.mode == "keep" and done.pause.frozen_engines == [engine]
        assert done.pause.requests_in_flight == 1 and done.calls[0].ok
        assert done.resume.prefix_cache_reset == dict.fromkeys(pool.engine_urls, "ok")
        resp = await gen
        out = await resp.json()
    assert out["usage"]["completion_tokens"] == 400 and out["choices"][0]["finish_reason"] == "length"
    sim = next(s.app[SIM_STATE] for s in pool.sims if s.base_url == engine)
    assert sim.engine.counters.num_preemptions == 1  # its KV of the old weights recomputed
    assert sim.weight_version == "9"


async def test_refusals_are_typed_errors(sim_pool: PoolFactory) -> None:
    pool = await sim_pool()
    async with AdminClient(pool.url, "wrong-token") as wrong:
        with pytest.raises(RouterHTTPError) as err:
            await wrong.pause()
    assert err.value.status == 401 and err.value.type == "authentication_error"
    async with AdminClient(pool.url, TOKEN) as admin:
        # The router's own check of a pass-through path, which EngineCall would refuse to build.
        async with aiohttp.ClientSession() as http, http.post(
                pool.url + "/admin/engines/call", json={"method": "POST", "path": "/v1/completions"},
                headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            refused = RouterHTTPError(resp.status, await resp.read(), url=str(resp.url))
        assert refused.status == 400 and refused.param == "path"
        # The client refuses what it can tell is wrong before sending it.
        with pytest.raises(ValueError, match="generation path"):
            EngineCall("/v1/completions")
        with pytest.raises(ValueError, match="'reboot' is not a valid EngineOp"):
            await admin.engines("reboot")
        with pytest.raises(ValueError, match="'later' is not a valid PauseMode"):
            await admin.pause("later")
    assert not pool.state.runner.paused


async def test_the_sync_admin_client_round_trip(sim_pool: PoolFactory) -> None:
    pool = await sim_pool()

    def trainer() -> tuple[bool, bool, str | None]:
        with SyncAdminClient(pool.url, TOKEN) as admin:
            paused = admin.pause("abort")
            done = admin.update_weights([EngineCall("/areal_update_weights", {"model_path": "/ckpt/1"})],
                                        version="1")
            return paused.paused, done.resume.paused, admin.status().engines[0].weight_version

    assert await asyncio.to_thread(trainer) == (True, False, "1")
