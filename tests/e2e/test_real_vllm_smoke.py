"""Smoke tests against the real vLLM CPU server, plus the harness's pure parts.

Why: the router and the simulator both claim to speak vLLM's dialect (token-id
prompts, ``usage`` with ``cached_tokens``, streaming usage, ``/metrics`` names).
These tests pin that dialect to what vLLM 0.32 actually does, through the
official ``openai`` client, so a drift in vLLM or in our assumptions shows up
here first. They also run the fidelity harness against the real server and
check that it sees what the traces were designed to provoke.

Tests marked ``e2e`` need the real server (``make e2e``); the unmarked ones
cover the pure builders and run in the ordinary ``make test``.
"""

from __future__ import annotations

import json
import random
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from misat_bench.fidelity import (
    FIRST_TOKEN_ID,
    M_PREEMPTIONS,
    M_PREFIX_HITS,
    M_PREFIX_QUERIES,
    TRACES,
    FidelityResult,
    compare,
    fits_trace,
    histogram_means,
    order_distance,
    oversubscribed_trace,
    parse_metrics,
    run_trace,
    thrash_trace,
)
from misat_bench.real_vllm import VllmServerSpec, server_command, server_env

MODEL = "tiny"
BLOCK = 128

REQUIRED_METRICS = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:cache_config_info",
    "vllm:time_to_first_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
}


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_TOKEN_ID, 2048) for _ in range(n)]


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.read()


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return dict(json.loads(resp.read()))


# ----------------------------------------------------------------------------- pure parts


def test_server_command_carries_the_flags_the_suite_relies_on(tmp_path: Path) -> None:
    spec = VllmServerSpec(model_dir=tmp_path, port=8123, core=1, num_gpu_blocks=16)
    cmd = server_command(spec, python="/x/python")
    assert cmd[:4] == ["/x/python", "-P", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in (
        "--enforce-eager",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enable-server-load-tracking",
    ):
        assert flag in cmd
    assert cmd[cmd.index("--num-gpu-blocks-override") + 1] == "16"
    assert cmd[cmd.index("--port") + 1] == "8123"


def test_server_env_pins_the_core_and_drops_the_kv_space_override(tmp_path: Path) -> None:
    spec = VllmServerSpec(model_dir=tmp_path, port=8123, core=1)
    env = server_env(spec, tmp_path, base={"VLLM_CPU_KVCACHE_SPACE": "", "PATH": "/bin"})
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path)
    assert env["PATH"] == "/bin"


def test_spec_rejects_a_kv_cache_smaller_than_one_sequence(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        VllmServerSpec(model_dir=tmp_path, port=1, num_gpu_blocks=4, max_model_len=1024)


def test_traces_are_seeded_and_share_prefixes_as_designed() -> None:
    assert fits_trace() == fits_trace()
    assert fits_trace(seed=1) != fits_trace(seed=2)
    reqs = {r.id: r for r in fits_trace().requests}
    # GRPO samples of one group repeat one prompt; groups differ.
    assert reqs["g0s0"].prompt == reqs["g0s3"].prompt != reqs["g1s0"].prompt
    # Session turns extend the previous turn's prompt and wait for it.
    t0, t1, t2 = reqs["a0t0"], reqs["a0t1"], reqs["a0t2"]
    assert t1.prompt[: len(t0.prompt)] == t0.prompt and t1.after == "a0t0"
    assert t2.prompt[: len(t1.prompt)] == t1.prompt and t2.after == "a0t1"
    assert max(len(r.prompt) + r.max_tokens for r in reqs.values()) <= 1024
    over = oversubscribed_trace().requests
    assert len(over) == 16
    assert all(len(r.prompt) == 100 and r.max_tokens == 400 and r.ignore_eos for r in over)
    # Thrash interleaves groups: every group's first sample precedes any second one.
    thrash = {r.id: r for r in thrash_trace().requests}
    assert len(thrash) == 44
    assert max(thrash[f"g{g}s0"].arrival_s for g in range(8)) < thrash["g0s1"].arrival_s
    assert thrash["g0s1"].prompt == thrash["g0s0"].prompt
    assert set(TRACES) == {"fits", "oversubscribed", "thrash"}


def test_parse_metrics_sums_engines_and_histogram_means() -> None:
    text = (
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="tiny"} 3\n'
        'vllm:num_preemptions_total{engine="1",model_name="tiny"} 4\n'
        'vllm:num_preemptions_total{engine="0",model_name="other"} 100\n'
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf"} 4\n'
        'vllm:e2e_request_latency_seconds_count{engine="0"} 4\n'
        'vllm:e2e_request_latency_seconds_sum{engine="0"} 2.0\n'
    )
    assert parse_metrics(text, model_name="tiny")[M_PREEMPTIONS] == 7
    assert parse_metrics(text)[M_PREEMPTIONS] == 107
    before = {"vllm:e2e_request_latency_seconds_count": 2.0, "vllm:e2e_request_latency_seconds_sum": 0.2}
    assert histogram_means(parse_metrics(text), before) == {"vllm:e2e_request_latency_seconds": pytest.approx(0.9)}


def _result(trace: str, hit: float, pre: float, waiting: float, order: list[str]) -> FidelityResult:
    return FidelityResult(
        trace=trace, base_url="x", cache_reset=True, wall_time_s=1.0, requests=len(order),
        errors=0, hit_rate=hit, client_hit_rate=hit, prefix_cache_queries=100.0,
        prefix_cache_hits=100.0 * hit, preemptions=pre, peak_waiting=waiting, peak_running=1.0,
        peak_kv_usage=1.0, scrapes=3, max_scrape_gap_s=0.3, completion_order=order,
        counters={}, latency_means_s={}, records=[],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (["x", "y", "z"], ["x", "y", "z"], 0.0),
        (["x", "y", "z"], ["z", "y", "x"], 1.0),
        (["x", "y", "z"], ["y", "x", "z"], 1 / 3),
        (["x", "y", "q"], ["y", "x"], 1.0),
    ],
    ids=["same", "reversed", "one-swap", "only-common-ids"],
)
def test_order_distance(a: list[str], b: list[str], expected: float) -> None:
    assert order_distance(a, b) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("sim", "hit_ok", "pre_ok", "pressure_ok"),
    [
        ((0.12, 17.0, 13.0), True, True, True),
        ((0.20, 17.0, 13.0), False, True, True),
        ((0.12, 21.0, 13.0), True, False, True),
        ((0.12, 0.0, 0.0), True, False, False),
    ],
    ids=["within-goals", "hit-rate-off", "preemptions-off", "no-collapse"],
)
def test_compare_checks_each_goal(
    sim: tuple[float, float, float], hit_ok: bool, pre_ok: bool, pressure_ok: bool
) -> None:
    real = _result("thrash", 0.10, 17.0, 11.0, ["a", "b"])
    cmp = compare(real, _result("thrash", *sim, ["b", "a"]))
    assert (cmp.hit_rate_ok, cmp.preemptions_ok, cmp.same_pressure) == (hit_ok, pre_ok, pressure_ok)
    assert cmp.order_distance == 1.0
    with pytest.raises(ValueError, match="different traces"):
        compare(real, _result("fits", *sim, ["a"]))


# ----------------------------------------------------------------------------- real server


@pytest.fixture(scope="module")
def client(vllm_base_urls: list[str]):  # type: ignore[no-untyped-def]
    """Official OpenAI client on server 0."""
    from openai import OpenAI

    return OpenAI(base_url=f"{vllm_base_urls[0]}/v1", api_key="unused", max_retries=0)


@pytest.mark.e2e
def test_both_servers_are_healthy_and_distinct(vllm_servers, vllm_base_urls) -> None:  # type: ignore[no-untyped-def]
    assert len({s.pid for s in vllm_servers}) == 2
    for url in vllm_base_urls:
        status, body = _get(f"{url}/health")
        assert status == 200
        status, body = _get(f"{url}/v1/models")
        assert [m["id"] for m in json.loads(body)["data"]] == [MODEL]


@pytest.mark.e2e
def test_completion_with_token_ids_returns_exact_usage_and_token_ids(client) -> None:  # type: ignore[no-untyped-def]
    prompt = _ids(1, 20)
    resp = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert resp.usage.prompt_tokens == 20
    assert resp.usage.completion_tokens == 8
    choice = resp.choices[0].model_extra
    assert len(choice["token_ids"]) == 8
    assert choice["prompt_token_ids"] == prompt


@pytest.mark.e2e
def test_text_prompt_and_tokenize_use_the_local_tokenizer(client, vllm_base_urls) -> None:  # type: ignore[no-untyped-def]
    tok = _post(f"{vllm_base_urls[0]}/tokenize", {"model": MODEL, "prompt": "t5 t6 t700"})
    assert tok["tokens"] == [5, 6, 700]
    resp = client.completions.create(
        model=MODEL, prompt="t5 t6 t700", max_tokens=6, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert resp.usage.prompt_tokens == 3
    words = resp.choices[0].text.split()
    assert words and all(re.fullmatch(r"t\d+|<unk>|<s>|</s>", w) for w in words)


@pytest.mark.e2e
def test_chat_completion_answers_with_the_chat_template(client) -> None:  # type: ignore[no-untyped-def]
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "t10 t11 t12"}],
        max_tokens=5,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    # <s> + "user" (<unk>) + 3 words + "assistant" (<unk>) from the template.
    assert resp.usage.prompt_tokens == 6
    assert resp.usage.completion_tokens == 5
    assert resp.choices[0].message.role == "assistant"
    assert isinstance(resp.choices[0].message.content, str)


@pytest.mark.e2e
def test_streaming_puts_usage_in_the_last_chunk(client) -> None:  # type: ignore[no-untyped-def]
    stream = client.completions.create(
        model=MODEL,
        prompt=_ids(2, 12),
        max_tokens=10,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip()


@pytest.mark.e2e
def test_repeated_prompt_reports_cached_full_blocks(client) -> None:  # type: ignore[no-untyped-def]
    prompt = _ids(3, 300)  # two full 128-token blocks and a partial one

    def cached() -> int:
        resp = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        details = resp.usage.prompt_tokens_details
        return int(details.cached_tokens or 0) if details else 0

    assert cached() == 0
    assert cached() == 2 * BLOCK


@pytest.mark.e2e
def test_metrics_expose_the_vllm_names_the_router_scrapes(client, vllm_base_urls) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt=_ids(4, 8), max_tokens=2)
    status, body = _get(f"{vllm_base_urls[0]}/metrics")
    assert status == 200
    samples = [s for f in text_string_to_metric_families(body.decode()) for s in f.samples]
    names = {s.name for s in samples}
    assert names >= REQUIRED_METRICS, REQUIRED_METRICS - names
    info = next(s for s in samples if s.name == "vllm:cache_config_info")
    assert info.labels["block_size"] == str(BLOCK)
    assert all(s.labels.get("model_name") == MODEL for s in samples if s.name.startswith("vllm:n"))
    load = json.loads(_get(f"{vllm_base_urls[0]}/load")[1])
    assert load["server_load"] == 0


FITS_EXPECTED_HIT_RATE = (2 * 3 * 256 + 2 * (128 + 256)) / (2 * 4 * 260 + 2 * (140 + 270 + 400))
"""Full 128-token blocks only: GRPO samples 2-4 hit 256 of 260, turn 2 hits 128 of 270,
turn 3 hits 256 of 400 (62.3%); vLLM reaches exactly this when nothing is evicted."""


@pytest.mark.e2e
async def test_fidelity_fits_trace_hits_every_shared_full_block(vllm_base_urls: list[str]) -> None:
    result = await run_trace(vllm_base_urls[1], fits_trace())
    assert result.cache_reset
    assert result.errors == 0
    assert result.preemptions == 0
    assert sorted(result.completion_order) == sorted(r.id for r in fits_trace().requests)
    assert result.hit_rate == pytest.approx(FITS_EXPECTED_HIT_RATE, abs=0.01)
    assert result.client_hit_rate == pytest.approx(result.hit_rate, abs=0.01)
    # Turns of a session finish in order (each waits for the previous one).
    order = result.completion_order
    assert order.index("a0t0") < order.index("a0t1") < order.index("a0t2")


@pytest.mark.e2e
async def test_fidelity_oversubscribed_trace_completes_and_reports_its_pressure(
    vllm_base_urls: list[str], record_figure: Callable[[str, object], None]
) -> None:
    result = await run_trace(vllm_base_urls[1], oversubscribed_trace())
    queue_s = result.latency_means_s["vllm:request_queue_time_seconds"]
    for name, value in [("preemptions", result.preemptions), ("queue_time_mean_s", queue_s),
                        ("peak_waiting", result.peak_waiting), ("peak_kv_usage", result.peak_kv_usage)]:
        record_figure(name, value)
    assert result.errors == 0
    assert all(r.completion_tokens == 400 for r in result.records)
    assert result.counters["vllm:request_success_total"] == 16
    assert result.counters[M_PREFIX_QUERIES] >= result.counters[M_PREFIX_HITS]
    # 16 x 500 tokens cannot all live in 2,048 tokens of KV when they overlap, but whether they
    # overlap is up to the shared 2-core machine: runs saw 9-20 preemptions and seconds of
    # queueing, and others saw none of either (mean queue time 15 us: the requests reached the
    # engine one after another). So preemptions, queue time and the sampled peaks are figures;
    # the pressure itself is asserted where the router creates it
    # (test_kv_pressure_misa_t_holds_and_preempts_less_than_least_loaded).


@pytest.mark.e2e
async def test_fidelity_thrash_trace_collapses_the_hit_rate(
    vllm_base_urls: list[str], record_figure: Callable[[str, object], None]
) -> None:
    result = await run_trace(vllm_base_urls[1], thrash_trace())
    record_figure("preemptions", result.preemptions)
    record_figure("queue_time_mean_s", result.latency_means_s["vllm:request_queue_time_seconds"])
    record_figure("hit_rate", result.hit_rate)
    assert result.errors == 0
    # Preemptions and queueing on this trace depend on how arrivals 20 ms apart meet the
    # server's steps: 9-12 preemptions in five runs (docs/fidelity.md), 0 in one
    # fresh-environment run. Figures, not conditions; the collapse is what the trace must show
    # (seven other groups pass through 16 blocks between two siblings, however they overlap).
    assert result.hit_rate is not None
    assert result.hit_rate < FITS_EXPECTED_HIT_RATE - 0.3
