"""Each adapter's real request shapes through a live router in front of simulated vLLM engines.

AReaL, verl and SkyRL are too heavy to import here; their shapes are pinned as data below, copied
from the framework code at the commit named (docs/integrations.md names the same commits).
"""

from __future__ import annotations

import asyncio
import pickle
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest

from misat_client import EngineCall, PauseMode, PauseResult, SyncAdminClient
from misat_client.adapters.actions import FanOutAction, NotRoutable, PassThroughAction, PauseAction, ResumeAction
from misat_client.adapters.areal import AReaLControl, LabelledBackend, admin_action
from misat_client.adapters.openai_agent import OpenAIAgentLoop, Trajectory
from misat_client.adapters.skyrl import (
    ControlCallFailed,
    ControlRequest,
    InferenceEngineInput,
    Piece,
    RouterInferenceClient,
    collective_rpc_request,
    continuation_body,
    control_actions,
    engine_output,
    fetch_weights_request,
    init_transfer_request,
    join_pieces,
    load_lora_request,
    parse_completion,
    pause_request,
    reset_prefix_cache_request,
    resume_request,
    session_key,
    sleep_request,
    split_session,
    unload_lora_request,
    update_weights_request,
    wake_up_request,
    world_size,
    world_size_request,
)
from misat_client.adapters.skyrl import completion_body as skyrl_completion_body
from misat_client.adapters.verl import HttpServerManager, completion_body, stop_reason
from misat_client.admin_models import EngineOp
from misat_sim.server import STATE as SIM_STATE

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


async def test_verl_trajectories_past_aiohttps_default_connection_cap_all_reach_the_router(
        fake_pool: PoolFactory) -> None:
    pool = await fake_pool()
    gate = pool.fakes[0].gate = asyncio.Event()  # every answer waits: all trajectories at once
    manager = HttpServerManager(pool.url, pool.model, default_max_tokens=2)
    n = 120  # aiohttp's default session holds 100 connections and queues the rest in the client
    tasks = [asyncio.create_task(manager.generate(f"traj-{i}", prompt_ids=[1, 2, 3], sampling_params={}))
             for i in range(n)]
    try:
        # Admitted (placed or held) by the router, where admission belongs.
        await pool.wait(lambda: len(pool.state.dispatcher.in_flight) + pool.state.runner.held_count() == n)
    finally:
        gate.set()
        try:
            outs = await asyncio.gather(*tasks)
        finally:
            await manager.close()
    assert [o.token_ids for o in outs] == [[0, 1]] * n


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


# ---- SkyRL, skyrl/backends/skyrl_train/inference_servers/ at a9564572eb8e91076be43c1bd5e4615e3de17265 ----

SKYRL_COMMIT = "a9564572eb8e91076be43c1bd5e4615e3de17265"
SKYRL_SAMPLING_PARAMS: dict[str, Any] = {
    # engine_utils.get_vllm_sampling_params(SamplingParams()) with skyrl/train/config/config.py's
    # defaults: max_generate_length 1024, temperature 1.0, top_p 1.0, top_k -1, min_p 0.0,
    # logprobs 1, stop None, no additional_kwargs.
    "min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True, "max_tokens": 1024,
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 1, "stop": None,
}
SKYRL_TRAJECTORY_ID = ("gsm8k-17", 0)
"""SkyRLGymGenerator.agent_loop's session id is f"{instance_id}_{repetition_id}" of its TrajectoryID."""
SKYRL_DELTA_UPDATE_INFO: dict[str, Any] = {
    # DeltaCheckpointPublisher.publish's answer, which DeltaWeightTransferSender passes to
    # fetch_weights and update_named_weights.
    "target_version": 3, "version": 3, "sync_dir": "s3://ckpt/sync", "uri": "s3://ckpt/sync/delta-00000003",
}
SKYRL_NCCL_UPDATE_INFO: dict[str, Any] = {
    # BroadcastWeightTransferSender: {**weight_metadata, "packed": True}.
    "names": ["model.embed_tokens.weight"], "dtype_names": ["bfloat16"], "shapes": [[2048, 64]], "packed": True,
}
SKYRL_CONTROL_CALLS: dict[str, tuple[str, Any, Any, str]] = {
    # RemoteInferenceClient's control calls, each sent to every server: (endpoint, json, params, method)
    # of its _call_all_servers (load/unload_lora_adapter post the same shapes themselves).
    "pause_generation()": ("/pause", None, {"mode": "keep", "clear_cache": "false"}, "POST"),
    "resume_generation()": ("/resume", None, None, "POST"),
    "sleep()": ("/sleep", None, {"level": "2"}, "POST"),
    "sleep(level=1, tags=['weights'])": ("/sleep", None, {"level": "1", "tags": ["weights"]}, "POST"),
    "wake_up()": ("/wake_up", None, {}, "POST"),
    "wake_up(tags=['kv_cache'])": ("/wake_up", None, {"tags": ["kv_cache"]}, "POST"),
    "wake_up(tags=['weights', 'kv_cache'])": ("/wake_up", None, {"tags": ["weights", "kv_cache"]}, "POST"),
    "reset_prefix_cache()": ("/reset_prefix_cache", {"reset_running_requests": False}, None, "POST"),
    "reset_prefix_cache(reset_running_requests=True)": ("/reset_prefix_cache", {"reset_running_requests": True}, None, "POST"),
    "fetch_weights(3, sync_dir, uri)": ("/fetch_weights", {"target_version": 3, "sync_dir": "s3://ckpt/sync", "uri": "s3://ckpt/sync/delta-00000003"}, None, "POST"),
    "start_weight_update()": ("/collective_rpc", {"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": True}}, None, "POST"),
    "update_named_weights(update_info)": ("/update_weights", {"update_info": SKYRL_DELTA_UPDATE_INFO}, None, "POST"),
    "update_weights_nccl(update_info)": ("/collective_rpc", {"method": "update_weights_nccl", "kwargs": {"update_info": SKYRL_NCCL_UPDATE_INFO}}, None, "POST"),
    "update_weights_ipc(update_info)": ("/collective_rpc", {"method": "update_weights_ipc", "kwargs": {"update_info": SKYRL_NCCL_UPDATE_INFO}}, None, "POST"),
    "finish_weight_update()": ("/collective_rpc", {"method": "skyrl_finish_weight_update"}, None, "POST"),
    "sleep_for_weight_sync()": ("/collective_rpc", {"method": "skyrl_sleep_for_weight_sync", "kwargs": {"offload_kv": True}}, None, "POST"),
    "wake_for_weight_sync(['weights'])": ("/collective_rpc", {"method": "skyrl_wake_for_weight_sync", "kwargs": {"tags": ["weights"]}}, None, "POST"),
    "load_lora_adapter('skyrl-lora', '/ckpt/lora')": ("/skyrl/v1/load_lora_adapter", {"lora_name": "skyrl-lora", "lora_path": "/ckpt/lora"}, None, "POST"),
    "unload_lora_adapter('skyrl-lora')": ("/v1/unload_lora_adapter", {"lora_name": "skyrl-lora"}, None, "POST"),
    "get_world_size()": ("/get_world_size", {}, None, "GET"),
}
SKYRL_BROADCAST_INIT_TWO_DEPLOYMENTS: list[dict[str, Any]] = [
    # BroadcastInitInfo(rank_offset=1, world_size=5).for_servers(2, 2, dp_size=1), to_api_payload() each.
    {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 5},
    {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 3, "world_size": 5},
]
SKYRL_BROADCAST_INIT_ONE_DEPLOYMENT: list[dict[str, Any]] = [
    # The same with dp_size=2: both servers are one deployment and share its rank offset.
    {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3},
    {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3},
]
SKYRL_DELTA_INIT_PAYLOAD: dict[str, Any] = {
    # DeltaInitInfo.to_api_payload(); for_servers copies it for every server.
    "base_model_path": "Qwen/Qwen3-0.6B", "local_checkpoint_dir": "/tmp/skyrl-delta", "cloud_download_workers": 4,
    "checkpoint_load_format": "vllm_multi_thread_safetensors", "multi_thread_safetensors_max_workers": 8,
}
VLLM_COMPLETION_ANSWER: dict[str, Any] = {
    # vLLM's /v1/completions answer with return_token_ids and logprobs=1 (one choice).
    "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "policy",
    "choices": [{"index": 0, "text": " 42", "finish_reason": "stop", "stop_reason": None, "prompt_logprobs": None,
                 "prompt_token_ids": [1, 2, 3], "token_ids": [604, 2],
                 "logprobs": {"text_offset": [0, 3], "tokens": [" 42", "</s>"], "token_logprobs": [-0.25, -0.5],
                              "top_logprobs": [{" 42": -0.25}, {"</s>": -0.5}]}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}
SKYRL_LIVE_PARAMS: dict[str, Any] = {**SKYRL_SAMPLING_PARAMS, "min_tokens": 0, "max_tokens": 8}
"""SkyRL's defaults with a short budget and no min_tokens: the simulator refuses min_tokens > 0
(its output lengths are drawn, not forced)."""


@dataclass
class LoraLoadRequest:
    """skyrl.backends.skyrl_train.weight_sync.LoraLoadRequest's fields (names, dtypes, shapes empty)."""

    lora_path: str = ""
    lora_name: str = ""
    names: list[str] = field(default_factory=list)


def skyrl_builders() -> dict[str, ControlRequest]:
    """This adapter's control requests, for the calls pinned in SKYRL_CONTROL_CALLS."""
    return {
        "pause_generation()": pause_request(),
        "resume_generation()": resume_request(),
        "sleep()": sleep_request(),
        "sleep(level=1, tags=['weights'])": sleep_request(1, ["weights"]),
        "wake_up()": wake_up_request(),
        "wake_up(tags=['kv_cache'])": wake_up_request(["kv_cache"]),
        "wake_up(tags=['weights', 'kv_cache'])": wake_up_request(["weights", "kv_cache"]),
        "reset_prefix_cache()": reset_prefix_cache_request(),
        "reset_prefix_cache(reset_running_requests=True)": reset_prefix_cache_request(True),
        "fetch_weights(3, sync_dir, uri)": fetch_weights_request(3, "s3://ckpt/sync", "s3://ckpt/sync/delta-00000003"),
        "start_weight_update()": collective_rpc_request("skyrl_start_weight_update", {"is_checkpoint_format": True}),
        "update_named_weights(update_info)": update_weights_request(SKYRL_DELTA_UPDATE_INFO),
        "update_weights_nccl(update_info)": collective_rpc_request("update_weights_nccl", {"update_info": SKYRL_NCCL_UPDATE_INFO}),
        "update_weights_ipc(update_info)": collective_rpc_request("update_weights_ipc", {"update_info": SKYRL_NCCL_UPDATE_INFO}),
        "finish_weight_update()": collective_rpc_request("skyrl_finish_weight_update"),
        "sleep_for_weight_sync()": collective_rpc_request("skyrl_sleep_for_weight_sync", {"offload_kv": True}),
        "wake_for_weight_sync(['weights'])": collective_rpc_request("skyrl_wake_for_weight_sync", {"tags": ["weights"]}),
        "load_lora_adapter('skyrl-lora', '/ckpt/lora')": load_lora_request("skyrl-lora", "/ckpt/lora"),
        "unload_lora_adapter('skyrl-lora')": unload_lora_request("skyrl-lora"),
        "get_world_size()": world_size_request(),
    }


def test_skyrl_sampling_params_and_answers_map_to_vllm_completions() -> None:
    body = skyrl_completion_body("policy", [1, 2, 3], SKYRL_SAMPLING_PARAMS, cache_salt="salt-v2")
    assert body == {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
                    "max_tokens": 1024, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 1,
                    "model": "policy", "prompt": [1, 2, 3], "return_token_ids": True, "cache_salt": "salt-v2"}
    assert "cache_salt" not in skyrl_completion_body("policy", [1], {})
    with pytest.raises(ValueError, match="n > 1"):
        skyrl_completion_body("policy", [1], {"n": 2})
    # After an abort: the same request, its output so far appended, the budgets reduced.
    again = continuation_body(body, [9, 9, 9, 9])
    assert again is not None and again["prompt"] == [1, 2, 3, 9, 9, 9, 9]
    assert (again["max_tokens"], again["min_tokens"], body["max_tokens"]) == (1020, 0, 1024)
    assert continuation_body({**body, "max_tokens": 4}, [9, 9, 9, 9]) is None

    answer = parse_completion(VLLM_COMPLETION_ANSWER)
    assert answer == Piece(" 42", [604, 2], [-0.25, -0.5], "stop")
    # The router's own abort (X-Misat-Abort: router): an empty choice, no token ids.
    router_abort = parse_completion({"choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "abort",
                                                  "stop_reason": None}]})
    assert router_abort == Piece("", [], None, "abort")
    with pytest.raises(ValueError, match="token_ids"):
        parse_completion({"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]})
    partial = Piece(" 4", [604], [-0.25], "abort")
    joined = join_pieces([partial, router_abort, Piece("2", [2], [-0.5], "stop")])
    assert joined == Piece(" 42", [604, 2], [-0.25, -0.5], "stop")
    out = engine_output([joined, Piece("", [], None, "length")], want_logprobs=True)
    assert out == {"responses": [" 42", ""], "response_ids": [[604, 2], []], "stop_reasons": ["stop", "length"],
                   "response_logprobs": [[-0.25, -0.5], []], "prompt_logprobs": None, "rollout_expert_indices": None}
    assert engine_output([joined], want_logprobs=False)["response_logprobs"] is None

    # chat_completion / completion payloads: SkyRL puts the session in the body.
    payload = {"json": {"model": "policy", "messages": [], "session_id": "gsm8k-17_0"}, "headers": {"X-A": "b"}}
    assert split_session(payload) == ("gsm8k-17_0", {"model": "policy", "messages": []})
    assert [session_key(s) for s in (None, "", 0, "a_0", 7)] == [None, None, None, "a_0", "7"]


def test_skyrl_control_calls_map_to_the_admin_api() -> None:
    requests = skyrl_builders()
    assert {k: (r.endpoint, r.json, r.params, r.method) for k, r in requests.items()} == SKYRL_CONTROL_CALLS
    assert sleep_request(2, uses_lora_weight_sync=True).params == {"level": "1"}  # SkyRL keeps the base weights
    actions: dict[str, object] = {}
    for name, req in requests.items():
        try:
            actions[name] = control_actions(req)
        except NotRoutable as exc:
            actions[name] = exc
    # vLLM's keep-mode pause is the router's keep pause, or a stand-in: abort (resubmitted by
    # generate) or wait. clear_cache goes with a stand-in only (vLLM ignores it with keep).
    assert actions["pause_generation()"] == (PauseAction(PauseMode.KEEP, reset_prefix_cache=False),)
    assert control_actions(pause_request(clear_cache=True)) == (PauseAction(PauseMode.KEEP, reset_prefix_cache=False),)
    assert control_actions(requests["pause_generation()"], PauseMode.WAIT) == (
        PauseAction(PauseMode.WAIT, reset_prefix_cache=False),)
    assert control_actions(pause_request(clear_cache=True), PauseMode.ABORT) == (
        PauseAction(PauseMode.ABORT, reset_prefix_cache=True),)
    assert control_actions(pause_request("abort", clear_cache=True), PauseMode.WAIT) == (
        PauseAction(PauseMode.ABORT, reset_prefix_cache=True),)
    assert actions["resume_generation()"] == (ResumeAction(reset_prefix_cache=False),)
    assert actions["sleep()"] == (FanOutAction(EngineOp.SLEEP, {"level": "2"}),)
    assert actions["sleep(level=1, tags=['weights'])"] == (FanOutAction(EngineOp.SLEEP, {"level": "1", "tags": "weights"}),)
    assert actions["wake_up()"] == (FanOutAction(EngineOp.WAKE_UP, {}),)
    assert actions["wake_up(tags=['kv_cache'])"] == (FanOutAction(EngineOp.WAKE_UP, {"tags": "kv_cache"}),)
    assert actions["reset_prefix_cache()"] == (FanOutAction(EngineOp.RESET_PREFIX_CACHE, {}),)
    # The flag in the body for SkyRL's server, in the query for stock vLLM.
    assert actions["reset_prefix_cache(reset_running_requests=True)"] == (
        PassThroughAction(EngineCall("/reset_prefix_cache", {"reset_running_requests": True},
                                     query={"reset_running_requests": "true"})),)
    passed = ["fetch_weights(3, sync_dir, uri)", "start_weight_update()", "update_named_weights(update_info)",
              "update_weights_nccl(update_info)", "finish_weight_update()", "sleep_for_weight_sync()",
              "wake_for_weight_sync(['weights'])", "load_lora_adapter('skyrl-lora', '/ckpt/lora')", "get_world_size()"]
    for name in passed:
        endpoint, body, _, method = SKYRL_CONTROL_CALLS[name]
        assert actions[name] == (PassThroughAction(EngineCall(endpoint, body, method)),), name
    for refused, why in [("wake_up(tags=['weights', 'kv_cache'])", "one value per key"),
                         ("update_weights_ipc(update_info)", "CUDA IPC"),
                         ("unload_lora_adapter('skyrl-lora')", "/v1/")]:
        assert isinstance(actions[refused], NotRoutable) and why in str(actions[refused]), refused
    assert set(actions) == set(passed) | {
        "pause_generation()", "resume_generation()", "sleep()", "sleep(level=1, tags=['weights'])", "wake_up()",
        "wake_up(tags=['kv_cache'])", "reset_prefix_cache()", "reset_prefix_cache(reset_running_requests=True)",
        "wake_up(tags=['weights', 'kv_cache'])", "update_weights_ipc(update_info)", "unload_lora_adapter('skyrl-lora')"}

    # The weight-transfer set-up: one pass-through body only when every engine's payload is the same.
    with pytest.raises(NotRoutable, match=r"differs per engine \(rank_offset\)"):
        init_transfer_request(SKYRL_BROADCAST_INIT_TWO_DEPLOYMENTS)
    for payloads in (SKYRL_BROADCAST_INIT_ONE_DEPLOYMENT, [SKYRL_DELTA_INIT_PAYLOAD] * 3):
        req = init_transfer_request(payloads)
        assert req == ControlRequest("/init_weight_transfer_engine", {"init_info": payloads[0]})
        assert control_actions(req) == (PassThroughAction(EngineCall(req.endpoint, req.json)),)
    # get_world_size as SkyRL counts it: vLLM reports a whole deployment's workers.
    answers = {f"http://e{i}": {"status": 200, "body": {"world_size": 2}} for i in range(4)}
    assert world_size(answers, 1) == (8, 2, 4)
    assert world_size(answers, 2) == (4, 2, 4)
    with pytest.raises(ValueError, match="differ in world size"):
        world_size({**answers, "http://e9": {"status": 200, "body": {"world_size": 4}}}, 1)


async def test_skyrl_trajectory_is_one_session_on_one_engine(sim_pool: PoolFactory) -> None:
    pool = await sim_pool()
    client = RouterInferenceClient(pool.url, TOKEN, model_name=pool.model)
    session_id = "{}_{}".format(*SKYRL_TRAJECTORY_ID)
    try:
        ids = list(range(10, 60))
        engines = []
        for _ in range(3):  # SkyRLGymGenerator.agent_loop: generate, step the env, append its observation
            out = await client.generate(InferenceEngineInput(prompt_token_ids=[ids], session_ids=[session_id],
                                                             sampling_params=SKYRL_LIVE_PARAMS, cache_salt=None),
                                        model=pool.model)
            response = out["response_ids"][0]
            assert 0 < len(response) <= 8 and out["stop_reasons"][0] in ("stop", "length")
            assert out["response_logprobs"] is not None and len(out["response_logprobs"][0]) == len(response)
            assert isinstance(out["responses"][0], str) and out["rollout_expert_indices"] is None
            engines.append(client.engine_of(session_id))
            ids = ids + response + [7, 7, 7]
        assert client.turns(session_id) == 3
        assert len(set(engines)) == 1 and engines[0] in pool.engine_urls
        record = pool.state.runner.sessions[session_id]
        assert record.workload_class == "agentic" and record.engine_id == engines[0]
        assert await decisions(pool, "continuation") == 2  # turns 1 and 2 were placed as the session's

        # generate_batched: no session ids, so requests of the single-turn class.
        batch = await client.generate({"prompt_token_ids": [[3, 4, 5], [6, 7, 8, 9]],
                                       "sampling_params": {**SKYRL_LIVE_PARAMS, "logprobs": None}})
        assert len(batch["response_ids"]) == 2 and all(batch["response_ids"]) and batch["response_logprobs"] is None
        await pool.wait(lambda: pool.live_sessions("rlvr") == 0)
        # chat_completion with the session in the body (SkyRL's HTTP endpoint shape).
        chat = await client.chat_completion({"json": {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 3, "session_id": "chat_0"}})
        assert chat["choices"][0]["message"]["role"] == "assistant" and client.turns("chat_0") == 1
        assert pool.state.runner.sessions["chat_0"].workload_class == "agentic"

        assert pool.live_sessions("agentic") == 2
        await client.finish_session(session_id)  # agent_loop's finally
        assert session_id not in pool.state.runner.sessions and client.turns(session_id) == 0
        await client.finish_session(session_id)  # no longer live: the router's 404 is not an error
        assert pool.live_sessions("agentic") == 1
        # SkyRL passes its client to Ray workers for weight syncs: it must pickle, connections left behind.
        copy = pickle.loads(pickle.dumps(client))
        assert copy.router_url == client.router_url and copy.turns("chat_0") == 0 and client.turns("chat_0") == 1
        with pytest.raises(ValueError, match="prompt_token_ids, not prompts"):
            await client.generate({"prompts": [[{"role": "user", "content": "x"}]]})
        with pytest.raises(NotRoutable, match="mm_features"):
            await client.generate({"prompt_token_ids": [[1]], "mm_features": [{"mm_hashes": {}}]})
        with pytest.raises(NotRoutable, match="render"):
            await client.render_chat_completion({"json": {"messages": []}})
    finally:
        await client.teardown()


LONG_SKYRL = 400
"""Tokens of a generation still running when the test pauses (about a second at time scale 1)."""


async def test_skyrl_pause_keeps_a_generation_frozen_until_the_resume(sim_pool: PoolFactory) -> None:
    pool = await sim_pool(time_scale=1.0)
    client = RouterInferenceClient(pool.url, TOKEN, model_name=pool.model)
    params = {**SKYRL_LIVE_PARAMS, "max_tokens": LONG_SKYRL, "ignore_eos": True}
    try:
        rollout = asyncio.create_task(client.generate(
            {"prompt_token_ids": [list(range(5, 50))], "session_ids": ["gsm8k-3_1"], "sampling_params": params}))
        await pool.wait(lambda: len(pool.state.dispatcher.in_flight) == 1)
        paused = await client.pause_generation()
        (engine,) = {f.engine_id for f in pool.state.dispatcher.in_flight.values()}
        assert paused.paused and paused.mode == "keep" and paused.aborted_requests == 0
        assert paused.frozen_engines == [engine] and paused.requests_in_flight == 1
        frozen = next(s.app[SIM_STATE] for s in pool.sims if s.base_url == engine)
        assert frozen.loop.frozen
        assert not rollout.done()
        resumed = await client.resume_generation()
        assert not resumed.paused and not frozen.loop.frozen
        out = await rollout
        assert len(out["response_ids"][0]) == LONG_SKYRL and out["stop_reasons"] == ["length"]
        assert client.turns("gsm8k-3_1") == 1  # one request, frozen and thawed: nothing sent again
    finally:
        await client.teardown()


async def test_skyrl_pause_aborts_and_generate_resubmits_one_whole_response(sim_pool: PoolFactory) -> None:
    pool = await sim_pool(time_scale=1.0)
    client = RouterInferenceClient(pool.url, TOKEN, model_name=pool.model, pause_mode=PauseMode.ABORT)
    params = {**SKYRL_LIVE_PARAMS, "max_tokens": LONG_SKYRL, "ignore_eos": True}
    try:
        rollout = asyncio.create_task(client.generate(
            {"prompt_token_ids": [list(range(5, 50))], "session_ids": ["gsm8k-3_1"], "sampling_params": params}))
        await pool.wait(lambda: len(pool.state.dispatcher.in_flight) == 1)
        paused = await client.pause_generation()
        assert paused.paused and paused.mode == "abort" and paused.aborted_requests == 1
        await pool.wait(lambda: pool.state.runner.held_count() == 1)  # the rest, sent again, held by the pause
        assert not rollout.done()
        resumed = await client.resume_generation()
        assert not resumed.paused
        out = await rollout
        assert len(out["response_ids"][0]) == LONG_SKYRL and out["stop_reasons"] == ["length"]
        assert out["response_logprobs"] is not None and len(out["response_logprobs"][0]) == LONG_SKYRL
        assert client.turns("gsm8k-3_1") == 2  # the resubmission was the session's next turn
    finally:
        await client.teardown()


async def test_skyrl_control_and_weight_sync_run_through_the_admin_api(sim_pool: PoolFactory) -> None:
    pool = await sim_pool()
    client = RouterInferenceClient(pool.url, TOKEN, model_name=pool.model)
    sims = [s.app[SIM_STATE] for s in pool.sims]
    try:
        slept = await client.sleep()
        assert set(slept) == set(pool.engine_urls) and {r["status"] for r in slept.values()} == {200}
        assert all(s.sleeping and s.sleep_level == 2 for s in sims)
        await client.wake_up(tags=["weights"])
        assert all(s.sleeping for s in sims)  # the KV cache still sleeps
        await client.wake_up(tags=["kv_cache"])
        assert not any(s.sleeping for s in sims)
        with pytest.raises(NotRoutable, match="one value per key"):
            await client.wake_up(tags=["weights", "kv_cache"])

        # DeltaWeightTransferSender._apply_receiver_update's sequence (its /fetch_weights below).
        paused = await client.pause_generation()
        assert paused.paused and pool.state.runner.paused
        reset = await client.reset_prefix_cache(reset_running_requests=True)
        assert set(reset) == set(pool.engine_urls)
        await client.start_weight_update(is_checkpoint_format=True)
        updated = await client.update_named_weights(SKYRL_DELTA_UPDATE_INFO)
        assert {r["status"] for r in updated.values()} == {200}
        await client.finish_weight_update()
        await client.resume_generation()
        client.increment_weight_version()
        assert not pool.state.runner.paused and client.weight_version == 1
        assert [s.weight_updates for s in sims] == [1] * len(sims)
        assert all(s.rpc_calls == ["skyrl_start_weight_update", "skyrl_finish_weight_update"] for s in sims)
        status = await asyncio.to_thread(client.admin.status)
        assert status.weight_versions() == dict.fromkeys(pool.engine_urls, "1")

        # An engine's refusal is raised, not swallowed (the simulator has no /fetch_weights, nor
        # SkyRL's LoRA endpoint, which a LoraLoadRequest from SkyRL's workers goes to).
        with pytest.raises(ControlCallFailed, match=r"POST /fetch_weights failed on .*status 404") as err:
            await client.fetch_weights(3, sync_dir="s3://ckpt/sync")
        assert set(err.value.result.failed()) == set(pool.engine_urls)
        with pytest.raises(ControlCallFailed, match="/skyrl/v1/load_lora_adapter"):
            await client.update_named_weights(LoraLoadRequest(lora_path="/ckpt/lora", lora_name="skyrl-lora"))
        with pytest.raises(NotRoutable, match="CUDA IPC"):
            await client.update_weights_ipc(SKYRL_NCCL_UPDATE_INFO)
        with pytest.raises(NotRoutable, match="/v1/"):
            await client.unload_lora_adapter("skyrl-lora")
        assert [s.weight_updates for s in sims] == [1] * len(sims)
    finally:
        await client.teardown()
