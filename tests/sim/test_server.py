"""The vLLM-compatible HTTP server: OpenAI client, streaming, metrics, errors, disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from misat_sim.config import SimEngineConfig
from misat_sim.server import STATE, build_parser, config_from_args, start_server

from .conftest import SERVED_MODEL as MODEL


async def _wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for a condition the server reaches on its own (bounded; not a fixed sleep)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


async def test_completion_with_token_ids_returns_ids_and_cached_tokens(client) -> None:
    prompt = list(range(3, 300))
    first = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, extra_body={"return_token_ids": True, "ignore_eos": True}
    )
    data = first.model_dump()
    assert data["prompt_token_ids"] == prompt
    choice = data["choices"][0]
    assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
    assert choice["text"] == " ".join(f"t{t}" for t in choice["token_ids"])
    assert first.usage.prompt_tokens == 297 and first.usage.completion_tokens == 5
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = await client.completions.create(model=MODEL, prompt=[prompt], max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 256  # two 128-token blocks


async def test_text_prompt_is_tokenized_like_the_real_tiny_tokenizer(client, server) -> None:
    r = await client.completions.create(model=MODEL, prompt="t5 t6 t7 hello", max_tokens=1)
    assert r.usage.prompt_tokens == 4
    async with (
        aiohttp.ClientSession() as s,
        s.post(server.base_url + "/tokenize", json={"prompt": "t5 t6 t7"}) as resp,
    ):
        body = await resp.json()
    assert body == {"count": 3, "max_model_len": 2048, "tokens": [5, 6, 7], "token_strs": None}


async def test_chat_completion(client) -> None:
    r = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "t10 t11"}], max_tokens=3
    )
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens <= 3
    assert r.usage.prompt_tokens == 4  # "user:", "t10", "t11", "assistant:"


async def test_streaming_puts_usage_in_the_last_chunk(client) -> None:
    stream = await client.completions.create(
        model=MODEL,
        prompt=[5, 6, 7],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks[:-1])
    assert len(text.split()) == 6


async def test_chat_streaming(client) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 4


async def test_metrics_have_vllm_names_and_labels(client, server) -> None:
    await client.completions.create(
        model=MODEL, prompt=list(range(3, 200)), max_tokens=3, extra_body={"ignore_eos": True}
    )
    async with aiohttp.ClientSession() as s, s.get(server.base_url + "/metrics") as resp:
        text = await resp.text()
    samples = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
    labels = {"engine": "0", "model_name": MODEL}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert samples[name].labels == labels, name
    assert samples["vllm:prompt_tokens_total"].value == 197
    assert samples["vllm:generation_tokens_total"].value == 3
    assert samples["vllm:prefix_cache_queries_total"].value == 197
    info = samples["vllm:cache_config_info"]
    assert info.value == 1 and info.labels["block_size"] == "128" and info.labels["num_gpu_blocks"] == "64"
    assert samples["vllm:time_to_first_token_seconds_count"].value == 1
    assert samples["vllm:e2e_request_latency_seconds_count"].value == 1
    assert samples["vllm:request_queue_time_seconds_count"].value == 1
    success = [
        s
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "length"
    ]
    assert success[0].value == 1


async def test_small_endpoints(server) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(server.base_url + "/health") as r:
            assert r.status == 200 and await r.read() == b""
        async with s.get(server.base_url + "/v1/models") as r:
            card = (await r.json())["data"][0]
            assert card["id"] == MODEL and card["max_model_len"] == 2048
        async with s.get(server.base_url + "/load") as r:
            assert await r.json() == {"server_load": 0}
        async with s.post(server.base_url + "/reset_prefix_cache") as r:
            assert r.status == 200 and r.headers["X-Prefix-Cache-Reset"] == "true"
            assert await r.json() == {"success": True}  # vLLM 0.32's answer


@pytest.mark.parametrize(
    ("body", "status", "err_type", "fragment"),
    [
        ({"model": "other", "prompt": "t5", "max_tokens": 2}, 404, "NotFoundError", "does not exist"),
        ({"model": MODEL, "prompt": "t5", "max_tokens": 0}, 400, "BadRequestError", "at least 1"),
        ({"model": MODEL, "prompt": "t5", "max_tokens": "many"}, 400, "BadRequestError", "max_tokens"),
        ({"model": MODEL, "prompt": "t5", "max_tokens": 2048}, 400, "BadRequestError", "too large"),
        (
            {"model": MODEL, "prompt": [5] * 2048, "max_tokens": 1},
            400,
            "BadRequestError",
            "maximum context length",
        ),
    ],
    ids=[
        "unknown-model",
        "max-tokens-0",
        "max-tokens-not-int",
        "prompt-plus-output-too-long",
        "prompt-too-long",
    ],
)
async def test_errors_have_vllm_bodies(server, body, status, err_type, fragment) -> None:
    async with aiohttp.ClientSession() as s, s.post(server.base_url + "/v1/completions", json=body) as r:
        assert r.status == status
        err = (await r.json())["error"]
    assert err["type"] == err_type and err["code"] == status and fragment in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


async def test_malformed_json_is_a_400(server) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            server.base_url + "/v1/completions",
            data=b"{not json",
            headers={"Content-Type": "application/json"},
        ) as r,
    ):
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "non-stream"])
async def test_client_disconnect_aborts_and_frees_blocks(streaming: bool) -> None:
    # Slow enough (time scale 10) that the request is still decoding when the client leaves.
    srv = await start_server(SimEngineConfig(profile="tiny-cpu", served_model_name=MODEL, time_scale=10.0))
    engine = srv.app[STATE].engine
    body = {
        "model": MODEL,
        "prompt": list(range(3, 100)),
        "max_tokens": 1900,
        "ignore_eos": True,
        "stream": streaming,
    }
    try:
        async with aiohttp.ClientSession() as s:
            if streaming:
                resp = await s.post(srv.base_url + "/v1/completions", json=body)
                await resp.content.readline()  # the first token arrived: the request holds KV
                resp.close()
            else:
                task = asyncio.create_task(s.post(srv.base_url + "/v1/completions", json=body))
                await _wait_for(lambda: engine.kv_cache_usage() > 0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        await _wait_for(lambda: not engine.has_unfinished_requests())
        assert engine.kv_cache_usage() == 0.0
        assert engine.counters.request_success["abort"] == 1
        assert engine.counters.request_success["length"] == 0
    finally:
        await srv.stop()


def test_command_line_maps_to_config() -> None:
    args = build_parser().parse_args(
        [
            "--profile",
            "tiny-cpu",
            "--port",
            "0",
            "--served-model-name",
            "m",
            "--time-scale",
            "10",
            "--seed",
            "4",
            "--num-gpu-blocks",
            "32",
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "1024",
            "--no-prefix-caching",
        ]
    )
    cfg = config_from_args(args)
    limits = cfg.resolve()
    assert (cfg.model_name(), cfg.time_scale, cfg.seed) == ("m", 10.0, 4)
    assert (limits.num_gpu_blocks, limits.max_num_seqs, limits.max_model_len) == (32, 8, 1024)
    assert limits.enable_prefix_caching is False


async def test_keep_up_is_served_as_json_and_a_misat_gauge(client, server) -> None:
    await client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, extra_body={"ignore_eos": True})
    async with aiohttp.ClientSession() as s:
        async with s.get(server.base_url + "/misat/keep_up") as resp:
            body = await resp.json()
        async with s.get(server.base_url + "/metrics") as resp:
            text = await resp.text()
    assert body["time_scale"] == 2000.0 and body["engine_index"] == 0
    assert body["busy_s"] > 0 and 0 < body["run"] <= 1.0 and body["skipped_s"] >= 0
    assert {"recent", "advanced_s", "delivery_lag_s", "low", "busy", "delivery_slice_s"} <= set(body)
    gauges = [s for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name == "misat_sim_keep_up_ratio"]
    assert {g.labels["window"] for g in gauges} >= {"run"}
    assert all(g.labels["engine"] == "0" and g.labels["model_name"] == MODEL for g in gauges)
