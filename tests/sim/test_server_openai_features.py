"""The simulator's OpenAI surface for RL trainers: n > 1, batched prompts, logprobs,
``return_tokens_as_token_ids``, refused parameters, and vLLM's engine control endpoints
(pause/resume with abort semantics, sleep/wake_up, weight versions)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from misat_sim.config import SimEngineConfig
from misat_sim.server import STATE, RunningServer, start_server

from .conftest import SERVED_MODEL as MODEL

WAIT_S = 5.0


@pytest.fixture
async def slow_server() -> AsyncIterator[RunningServer]:
    """Real time (scale 1): a long generation stays in flight while a test pauses the engine."""
    cfg = SimEngineConfig(profile="tiny-cpu", served_model_name=MODEL, time_scale=1.0, seed=3)
    srv = await start_server(cfg)
    yield srv
    await srv.stop()


async def _until(predicate: Callable[[], bool]) -> None:
    """Wait (bounded) for a state the server reaches on its own."""

    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), WAIT_S)


async def _until_generating(srv: RunningServer, n_children: int) -> None:
    """Wait (bounded) until ``n_children`` requests have emitted at least one token."""
    state = srv.app[STATE]

    async def ready() -> None:
        while True:
            reqs = [state.engine.get_request(c) for c in list(state.live)]
            if len(reqs) == n_children and all(r is not None and r.num_output_tokens > 0 for r in reqs):
                return
            await asyncio.sleep(0.01)

    await asyncio.wait_for(ready(), WAIT_S)


async def test_n_samples_share_the_prompt_and_usage_counts_it_once(client) -> None:
    prompt = list(range(3, 300))
    r = await client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=6,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    outputs = [tuple(c.model_dump()["token_ids"]) for c in r.choices]
    assert all(len(o) == 6 for o in outputs)
    assert len(set(outputs)) == 4  # four different samples, not one repeated
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == 24
    # The children after the first found the prompt's full blocks cached (vLLM's parallel sampling).
    again = await client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 256


async def test_seeded_samples_are_reproducible_and_distinct(client) -> None:
    kw = {"model": MODEL, "prompt": "t5 t6 t7", "n": 3, "max_tokens": 5, "seed": 11,
          "extra_body": {"ignore_eos": True}}
    a = await client.completions.create(**kw)
    b = await client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) == 3


async def test_batched_prompts_give_one_choice_per_prompt_and_sample(client) -> None:
    r = await client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=3,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    choices = [c.model_dump() for c in r.choices]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    # vLLM's order: prompt 0's samples, then prompt 1's.
    assert [c["prompt_token_ids"] for c in choices] == [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    texts = await client.completions.create(model=MODEL, prompt=["t5 t6", "t7"], max_tokens=2)
    assert len(texts.choices) == 2 and texts.usage.prompt_tokens == 3


async def test_streaming_n_samples_finishes_every_choice(client) -> None:
    stream = await client.completions.create(model=MODEL, prompt="t5 t6", n=3, max_tokens=4, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    text: dict[int, str] = {0: "", 1: "", 2: ""}
    finish: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert all(len(t.split()) == 4 for t in text.values())
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens == 2


async def test_completion_logprobs_have_vllm_shape_and_valid_values(client) -> None:
    r = await client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, logprobs=3, seed=1,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.choices[0]
    lp = choice.logprobs
    assert lp is not None
    ids = choice.model_dump()["token_ids"]
    assert lp.tokens == [f"t{ids[0]}"] + [f" t{t}" for t in ids[1:]]
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0.0
        assert 3 <= len(top) <= 4  # the top 3, plus the sampled token when it is not among them
        assert top[tok] == value
        others = [v for t, v in top.items() if t != tok]
        assert others == sorted(others, reverse=True)
    again = await client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, logprobs=3, seed=1,
                                            extra_body={"ignore_eos": True})
    assert again.choices[0].logprobs.token_logprobs == lp.token_logprobs


async def test_greedy_token_is_the_most_likely(client) -> None:
    r = await client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=4, logprobs=2, temperature=0,
                                        extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value == max(top.values())


async def test_tokens_as_token_ids_as_areal_reads_them(server) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, "return_token_ids": True, "top_k": -1, "top_p": 1.0,
            "stop_token_ids": [2], "skip_special_tokens": True, "use_beam_search": False}
    async with aiohttp.ClientSession() as s, s.post(server.base_url + "/v1/completions", json=body) as r:
        assert r.status == 200
        out = await r.json()
    choice = out["choices"][0]
    tokens = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    assert tokens == choice["token_ids"]
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"])  # logprobs=0: the sampled one


async def test_chat_logprobs_content(client) -> None:
    r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t9"}],
                                             max_tokens=3, logprobs=True, top_logprobs=2,
                                             extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert item.token.startswith("token_id:") and item.logprob <= 0
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].token == item.token  # vLLM lists the sampled token first


async def test_streamed_logprobs_match_the_full_answer(client) -> None:
    kw = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "logprobs": 1, "seed": 4,
          "extra_body": {"ignore_eos": True}}
    full = await client.completions.create(**kw)
    streamed: list[float] = []
    offsets: list[int] = []
    async for chunk in await client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert streamed == full.choices[0].logprobs.token_logprobs
    assert offsets == full.choices[0].logprobs.text_offset


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"echo": True}, "echo"),
        ({"stop": ["t5"]}, "stop"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"n": 0}, "n"),
    ],
)
async def test_unsimulated_parameters_are_refused_by_name(server, extra, param) -> None:
    body = {"model": MODEL, "prompt": "t5", "max_tokens": 2, **extra}
    async with aiohttp.ClientSession() as s, s.post(server.base_url + "/v1/completions", json=body) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and err["code"] == 400


async def test_chat_top_logprobs_without_logprobs_is_refused(server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "top_logprobs": 2}
    async with aiohttp.ClientSession() as s, s.post(server.base_url + "/v1/chat/completions", json=body) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "top_logprobs"


async def test_pause_abort_answers_partial_output_with_finish_reason_abort(slow_server) -> None:
    url = slow_server.base_url
    state = slow_server.app[STATE]
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True, "n": 2,
            "return_token_ids": True, "logprobs": 0}
    async with aiohttp.ClientSession() as s:
        full = asyncio.create_task(s.post(url + "/v1/completions", json=body))
        await _until_generating(slow_server, 2)
        async with s.post(url + "/pause", params={"mode": "abort"}) as r:
            assert r.status == 200 and await r.json() == {"status": "paused"}
        resp = await asyncio.wait_for(full, WAIT_S)
        out = await resp.json()
        resp.release()
        assert [c["finish_reason"] for c in out["choices"]] == ["abort", "abort"]
        for c in out["choices"]:
            assert 0 < len(c["token_ids"]) < 1500
            assert len(c["logprobs"]["tokens"]) == len(c["token_ids"])
        assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])
        assert state.engine.kv_cache_usage() == 0.0 and not state.live
        async with s.get(url + "/is_paused") as r:
            assert await r.json() == {"is_paused": True}
        # Paused: a new request is accepted and waits; resume lets it run.
        waiting = asyncio.create_task(s.post(url + "/v1/completions",
                                             json={"model": MODEL, "prompt": [5], "max_tokens": 2}))
        await _until(lambda: state.waiting == 1)
        assert not waiting.done()
        async with s.post(url + "/resume") as r:
            assert await r.json() == {"status": "resumed"}
        resp = await asyncio.wait_for(waiting, WAIT_S)
        assert resp.status == 200
        resp.release()


async def test_streaming_abort_ends_with_an_abort_chunk(slow_server) -> None:
    url = slow_server.base_url
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url + "/v1/completions", json=body)
        await _until_generating(slow_server, 1)
        async with s.post(url + "/abort_requests", json={}) as r:
            assert (await r.json()) == {"status": "aborted", "aborted": 1}
        events = [json.loads(line[6:]) for line in (await asyncio.wait_for(resp.read(), WAIT_S)).decode().split("\n\n")
                  if line.startswith("data: {")]
        resp.release()
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["abort"]
    streamed = sum(len(c["text"].split()) for e in events for c in e["choices"])
    assert streamed > 0 and events[-1]["usage"]["completion_tokens"] == streamed


async def test_sleep_and_wake_up(slow_server) -> None:
    url = slow_server.base_url
    state = slow_server.app[STATE]
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/sleep", params={"level": "1"}) as r:
            assert r.status == 200
        async with s.get(url + "/is_sleeping") as r:
            assert await r.json() == {"is_sleeping": True}
        waiting = asyncio.create_task(s.post(url + "/v1/completions",
                                             json={"model": MODEL, "prompt": [5], "max_tokens": 1}))
        await _until(lambda: state.waiting == 1)
        async with s.post(url + "/wake_up", params={"tags": "weights"}) as r:
            assert r.status == 200
        assert state.waiting == 1 and not waiting.done()  # the KV cache is still asleep
        async with s.post(url + "/wake_up") as r:
            assert r.status == 200
        resp = await asyncio.wait_for(waiting, WAIT_S)
        assert resp.status == 200
        resp.release()
        async with s.get(url + "/is_sleeping") as r:
            assert await r.json() == {"is_sleeping": False}
        async with s.post(url + "/sleep", params={"level": "7"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "level"
        async with s.post(url + "/pause", params={"mode": "later"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "mode"


async def test_weight_version_endpoints(server) -> None:
    url = server.base_url
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/weight_info") as r:
            assert await r.json() == {"weight_version": None}
        async with s.post(url + "/update_weights", json={"update_info": {"names": []}}) as r:
            assert r.status == 200
        async with s.post(url + "/finish_weight_update", json={"weight_version": "step-3"}) as r:
            assert r.status == 200
        async with s.get(url + "/weight_info") as r:
            assert await r.json() == {"weight_version": "step-3"}
        async with s.post(url + "/update_weight_version", json={"new_version": "step-4"}) as r:
            assert await r.json() == {"success": True, "new_version": "step-4"}
        async with s.post(url + "/areal_update_weights", json={"model_path": "/ckpt/step-5"}) as r:
            assert (await r.json())["success"] is True
        async with s.get(url + "/weight_info") as r:
            assert await r.json() == {"weight_version": "/ckpt/step-5"}
        async with s.post(url + "/update_weights", json={}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "update_info"
        async with s.post(url + "/collective_rpc", json={"method": "reload_weights"}) as r:
            assert await r.json() == {"results": [None]}
    assert server.app[STATE].weight_updates == 2
