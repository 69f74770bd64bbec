"""Each adapter's real request shapes through a live router in front of simulated vLLM engines.

AReaL and verl are too heavy to import here; their shapes are pinned as data below, copied from
the framework code at the commit named (docs/integrations.md names the same commits).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest

from misat_client import PauseResult, SyncAdminClient
from misat_client.adapters.areal import (
    AReaLControl,
    FanOutAction,
    LabelledBackend,
    NotRoutable,
    PassThroughAction,
    PauseAction,
    ResumeAction,
    admin_action,
)
from misat_client.adapters.openai_agent import OpenAIAgentLoop, Trajectory
from misat_client.adapters.verl import HttpServerManager, completion_body, stop_reason
from misat_client.admin_models import EngineOp

from .conftest import TOKEN, Pool, PoolFactory

# ---- AReaL, areal/engine/vllm_remote.py at 4aef98d8d818af55b43621aaadba047ae10f4e77 -----------

AREAL_COMMIT = "4aef98d8d818af55b43621aaadba047ae10f4e77"
AREAL_COMPLETION_PAYLOAD: dict[str, Any] = {
    # VLLMBackend.build_generation_request, text-only branch, with AReaL's GenerationHyperparameters
    # defaults (top_p 1.0, top_k -1, temperature 1.0, no stop ids, ignore_eos False, skip_special_tokens
    # True, use_beam_search False); max_tokens is gconfig.max_new_tokens, "prompt" is req.input_ids.
    "top_p": 1.0, "top_k": -1, "max_tokens": 6, "temperature": 1.0, "stop_token_ids": [],
    "ignore_eos": False, "skip_special_tokens": True, "return_tokens_as_token_ids": True, "logprobs": 0,
    "use_beam_search": False, "stream": False,
}
AREAL_CONTROL_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    # (endpoint, payload, method) of get_pause_request, get_resume_request, get_offload_request,
    # get_onload_request(tags), build_disk_weight_update_requests (full weights),
    # build_distributed_weight_update_requests (full weights), build_init_weights_group_request,
    # build_disk_weight_update_requests (LoRA).
    ("/areal_pause_generation", {}, "POST"),
    ("/areal_continue_generation", {}, "POST"),
    ("/sleep", {}, "POST"),
    ("/wake_up?tags=weights", {}, "POST"),
    ("/wake_up?tags=weights&tags=kv_cache", {}, "POST"),
    ("/areal_update_weights", {"model_path": "/ckpt/step-3"}, "POST"),
    ("/areal_set_update_weight_meta", {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 2]],
                                       "group_name": "update_weight_group"}, "POST"),
    ("/areal_update_weights_xccl", {}, "POST"),
    ("/areal_init_weights_update_group", {"master_address": "10.0.0.1", "master_port": "29500",
                                          "rank_offset": 1, "world_size": 3, "backend": "nccl",
                                          "group_name": "update_weight_group"}, "POST"),
    ("/v1/load_lora_adapter", {"lora_path": "/ckpt/lora", "lora_name": "policy-v3"}, "POST"),
]


@dataclass
class HttpRequest:
    """areal.api.io_struct.HttpRequest's fields."""

    endpoint: str
    payload: dict[str, Any]
    method: str = "POST"


@dataclass
class ModelRequest:
    """The fields of areal.api.ModelRequest that the backend reads."""

    rid: str
    input_ids: list[int]
    gconfig: dict[str, Any] = field(default_factory=dict)


class PinnedVLLMBackend:
    """Stands in for AReaL's VLLMBackend: its completion request shape, as pinned above."""

    def build_generation_request(self, req: ModelRequest, with_lora: bool, version: int) -> HttpRequest:
        return HttpRequest("/v1/completions", {**AREAL_COMPLETION_PAYLOAD, "prompt": list(req.input_ids)})

    def get_pause_request(self) -> HttpRequest:
        return HttpRequest("/areal_pause_generation", {})


def areal_tokens(choice: dict[str, Any]) -> tuple[list[int], list[float]]:
    """How AReaL's parse_generation_response reads an answer: "token_id:<id>" strings split on ':'."""
    return [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]], choice["logprobs"]["token_logprobs"]


async def test_areal_generation_is_labelled_in_the_body_and_parses_as_areal_reads_it(sim_pool: PoolFactory) -> None:
    pool = await sim_pool()
    backend = LabelledBackend(PinnedVLLMBackend(), "agentic")
    assert backend.get_pause_request().endpoint == "/areal_pause_generation"  # the rest is AReaL's own
    req = ModelRequest(rid="areal-rid-1", input_ids=list(range(5, 40)))
    engines = []
    async with aiohttp.ClientSession() as http:  # AReaL's arequest_with_retry: a JSON POST, no headers
        for turn in range(2):
            http_req = backend.build_generation_request(req, False, 0)
            assert http_req.payload["rollout"] == {"class": "agentic", "session_id": "areal-rid-1", "turn": turn}
            async with http.request(http_req.method, pool.url + http_req.endpoint, json=http_req.payload) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()
                engines.append(resp.headers["X-Misat-Engine"])
            choice = answer["choices"][0]
            tokens, logprobs = areal_tokens(choice)
            assert len(tokens) == len(logprobs) == answer["usage"]["completion_tokens"] > 0
            assert all(lp <= 0 for lp in logprobs)
            assert choice["finish_reason"] in ("stop", "length")
            req.input_ids += tokens  # AReaL's resubmission after an abort: same rid, output appended
        assert "rollout" not in PinnedVLLMBackend().build_generation_request(req, False, 0).payload
    assert engines[0] == engines[1]  # the second turn went where the first turn's KV is
    assert pool.live_sessions("agentic") == 1


def test_areal_control_requests_map_to_the_admin_api() -> None:
    actions: dict[str, object] = {}
    for endpoint, payload, method in AREAL_CONTROL_REQUESTS:
        try:
            actions[endpoint] = admin_action(endpoint, payload, method)
        except NotRoutable as exc:
            actions[endpoint] = exc
    assert actions["/areal_pause_generation"] == PauseAction()
    assert actions["/areal_continue_generation"] == ResumeAction()
    assert actions["/sleep"] == FanOutAction(EngineOp.SLEEP, {})
    assert actions["/wake_up?tags=weights"] == FanOutAction(EngineOp.WAKE_UP, {"tags": "weights"})
    disk = actions["/areal_update_weights"]
    assert isinstance(disk, PassThroughAction)
    assert (disk.call.path, disk.call.body, disk.call.method) == ("/areal_update_weights",
                                                                   {"model_path": "/ckpt/step-3"}, "POST")
    assert isinstance(actions["/areal_set_update_weight_meta"], PassThroughAction)
    assert isinstance(actions["/areal_update_weights_xccl"], PassThroughAction)
    for refused, why in [("/wake_up?tags=weights&tags=kv_cache", "repeated"),
                         ("/areal_init_weights_update_group", "differs per server"),
                         ("/v1/load_lora_adapter", "/v1/")]:
        assert isinstance(actions[refused], NotRoutable) and why in str(actions[refused]), refused


async def test_areal_control_runs_through_the_admin_api(sim_pool: PoolFactory) -> None:
    pool = await sim_pool()
    control = AReaLControl(SyncAdminClient(pool.url, TOKEN))
    paused = await asyncio.to_thread(control.run, HttpRequest("/areal_pause_generation", {}))
    assert isinstance(paused, PauseResult) and paused.paused and pool.state.runner.paused
    assert paused.mode == "abort"
    resumed = await asyncio.to_thread(control.continue_generation, 2)
    assert not resumed.paused and not pool.state.runner.paused
    update = await asyncio.to_thread(
        control.update_weights, [HttpRequest("/areal_update_weights", {"model_path": "/ckpt/step-3"})], 3)
    assert [c.ok for c in update.calls] == [True]
    assert set(update.calls[0].engines) == set(pool.engine_urls)
    assert update.resume.weight_version == "3" and not update.resume.paused
    status = await asyncio.to_thread(control.admin.status)
    assert status.weight_versions() == dict.fromkeys(pool.engine_urls, "3")


# ---- verl, verl/experimental/agent_loop/agent_loop.py at b178a3cd56f58b2d502255daba591e92833930a7 ----

VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"
VERL_SAMPLING_PARAMS: dict[str, Any] = {
    # AgentLoopWorker.generate_sequences: temperature, top_p, top_k from the rollout config,
    # repetition_penalty 1.0, logprobs = calculate_log_probs.
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True,
}


def test_verl_sampling_params_become_a_vllm_completion_body() -> None:
    body = completion_body("policy", [1, 2], {**VERL_SAMPLING_PARAMS, "max_new_tokens": 7}, 99)
    assert body == {"model": "policy", "prompt": [1, 2], "max_tokens": 7, "return_token_ids": True,
                    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                    "logprobs": 0, "return_tokens_as_token_ids": True}
    assert "logprobs" not in completion_body("policy", [1], {"logprobs": False}, 5)
    assert completion_body("policy", [1], {}, 5)["max_tokens"] == 5
    assert [stop_reason(r) for r in ("abort", "stop", "length", "tool_calls")] == [
        "aborted", "completed", "completed", "tool_calls"]


async def test_verl_generate_is_sticky_by_request_id(sim_pool: PoolFactory) -> None:
    pool = await sim_pool()
    manager = HttpServerManager(pool.url, pool.model, default_max_tokens=5)
    try:
        prompt = list(range(10, 60))
        outs = []
        for _ in range(2):
            out = await manager.generate("traj-9", prompt_ids=prompt, sampling_params=dict(VERL_SAMPLING_PARAMS))
            outs.append(out)
            assert 0 < len(out.token_ids) <= 5 and out.stop_reason == "completed"
            assert out.log_probs is not None and len(out.log_probs) == len(out.token_ids)
            prompt = prompt + out.token_ids + [7, 7]  # the tool's observation tokens
        assert manager.turns("traj-9") == 2
        assert pool.live_sessions("agentic") == 1
        sessions = pool.state.runner.sessions
        assert "traj-9" in sessions
        no_lp = await manager.generate("other", prompt_ids=[3, 4, 5], sampling_params={"max_tokens": 2})
        assert no_lp.log_probs is None and len(no_lp.token_ids) <= 2
        with pytest.raises(NotImplementedError, match="multi-modal"):
            await manager.generate("img", prompt_ids=[1], sampling_params={}, image_data=[object()])
        assert await manager.end_session("traj-9") is True
        assert "traj-9" not in pool.state.runner.sessions
    finally:
        await manager.close()


# ---- a plain OpenAI-SDK agent loop -------------------------------------------------------------


async def decisions(pool: Pool, reason: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(pool.url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("misat_decisions_total{") and f'reason="{reason}"' in line
               and 'class="agentic"' in line)


async def test_the_openai_agent_loop_runs_turns_with_tool_gaps_in_one_session(sim_pool: PoolFactory) -> None:
    pool = await sim_pool()
    client = openai.AsyncOpenAI(base_url=pool.url + "/v1", api_key="unused")
    gaps: list[int] = []

    async def tool_step(messages: list[dict[str, Any]], reply: Any) -> list[dict[str, Any]] | None:
        gaps.append(len(messages))
        assert pool.live_sessions("agentic") == 1  # the session lives on through the tool gap
        if len(gaps) == 3:
            return None
        return [{"role": "user", "content": f"tool result {len(gaps)}: t1 t2 t3"}]

    loop = OpenAIAgentLoop(client, model=pool.model, max_turns=8, sampling={"max_tokens": 4, "logprobs": True})
    trajectory = await loop.run([{"role": "user", "content": "solve t5 t6"}], tool_step)
    await client.close()
    assert isinstance(trajectory, Trajectory) and trajectory.turns == 3
    assert trajectory.completion_tokens > 0 and all(r in ("stop", "length") for r in trajectory.finish_reasons)
    assert all(r.choices[0].logprobs is not None for r in trajectory.replies)
    assert [m["role"] for m in trajectory.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert pool.live_sessions("agentic") == 0  # ended when the loop did
    assert await decisions(pool, "continuation") == 2


async def test_the_agent_loop_ends_at_max_turns_with_the_end_header(sim_pool: PoolFactory) -> None:
    pool = await sim_pool()
    client = openai.AsyncOpenAI(base_url=pool.url + "/v1", api_key="unused")

    async def forever(messages: list[dict[str, Any]], reply: Any) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "again"}]

    loop = OpenAIAgentLoop(client, model=pool.model, max_turns=2, sampling={"max_tokens": 2})
    trajectory = await loop.run([{"role": "user", "content": "go"}], forever)
    await client.close()
    assert trajectory.turns == 2
    assert pool.live_sessions("agentic") == 0
