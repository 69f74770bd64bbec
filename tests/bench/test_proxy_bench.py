"""The proxy benchmark's pure parts: stub answers, wrk's result line, the summary and the profile split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from misat_bench.proxy_bench import (
    DIRECT,
    Measurement,
    MetricsPage,
    WrkResult,
    completion_answer,
    logprobs_answer,
    metrics_page,
    nginx_config,
    parse_extra,
    parse_wrk_output,
    profile_split,
    prompts,
    request_body,
    summarise,
    wrk_script,
)
from misat_router.policy.types import RequestMeta
from misat_router.usage import usage_from_json
from misat_router.vllm_metrics import parse_vllm_page


@pytest.mark.parametrize("page", list(MetricsPage))
def test_stub_metrics_page_is_a_healthy_idle_vllm_engine(page: MetricsPage) -> None:
    metrics, seen = parse_vllm_page(metrics_page(1, page))
    assert seen and metrics.kv_capacity_tokens > 1_000_000 and metrics.kv_usage == 0.0
    assert metrics.num_running == metrics.num_waiting == 0


def test_the_vllm_stub_page_is_the_recorded_page_with_the_stubs_values() -> None:
    page = metrics_page(1, MetricsPage.VLLM)
    minimal = metrics_page(1, MetricsPage.MINIMAL)
    assert page.endswith(minimal) and page.count("\n") > 10 * minimal.count("\n")
    # The recorded engine's own values are gone: each read series is written once, the stub's.
    assert page.count("vllm:num_requests_running{") == 1 and page.count("# TYPE vllm:cache_config_info ") == 1
    assert "vllm:time_to_first_token_seconds_bucket" in page and "process_cpu_seconds_total" in page


def test_stub_completion_answer_carries_usage_the_router_reads() -> None:
    body = json.dumps(completion_answer(512), separators=(",", ":")).encode()
    c = usage_from_json(body, RequestMeta("r", "rlvr", prompt_tokens=3), ok=True)
    assert (c.prompt_tokens, c.completion_tokens) == (512, 1)


def test_long_answer_usage_is_read_exactly() -> None:
    body = json.dumps(logprobs_answer(512, 64), separators=(",", ":")).encode()
    c = usage_from_json(body, RequestMeta("r", "rlvr", prompt_tokens=3), ok=True)
    assert (c.prompt_tokens, c.completion_tokens) == (512, 64)
    assert len(json.loads(body)["choices"][0]["logprobs"]["top_logprobs"]) == 64


def test_hot_functions_are_timed() -> None:
    from misat_bench.proxy_bench import ProxyBenchSettings, time_hot_functions
    times = time_hot_functions(ProxyBenchSettings(prompts=2, prompt_tokens=64), calls=5)
    assert set(times) == {"parse_request_us", "usage_from_json_us", "usage_from_json_256_tokens_logprobs_us",
                          "parse_vllm_page_vllm_us"}
    assert all(v > 0 for v in times.values())


def test_nginx_config_serves_each_port_and_refuses_variables(tmp_path: Path) -> None:
    conf = nginx_config(tmp_path, [18001, 18002], 1, 512)
    assert "listen 127.0.0.1:18001" in conf and "listen 127.0.0.1:18002" in conf
    assert f"alias {tmp_path}/metrics-1.txt" in conf and '"prompt_tokens":512' in conf
    from misat_bench.proxy_bench import _nginx_literal
    with pytest.raises(ValueError, match=r"\$"):
        _nginx_literal("costs $5")
    assert _nginx_literal("it's") == "'it\\'s'"


def test_prompts_are_seeded_distinct_and_sized() -> None:
    a, b = prompts(3, 512, seed=1), prompts(3, 512, seed=1)
    assert a == b and len({tuple(p) for p in a}) == 3 and all(len(p) == 512 for p in a)
    body = json.loads(request_body(a[0]))
    assert body["prompt"] == a[0] and body["max_tokens"] == 1
    script = wrk_script([request_body(p) for p in a])
    assert script.count("[[{") == 3 and "function done" in script


def test_wrk_result_line() -> None:
    out = ("Running 1s test\n  1 threads and 64 connections\n"
           'PROXYBENCH {"requests":2000,"duration_us":1000000,"connect":0,"read":0,"write":0,"status":3,'
           '"timeout":0,"p50_us":120,"p90_us":300,"p99_us":900}\n')
    r = parse_wrk_output(out)
    assert r.requests_per_s == 2000 and r.errors == 3 and r.p50_us == 120
    with pytest.raises(RuntimeError, match="no result line"):
        parse_wrk_output("wrk: connection refused\n")


def _wrk(rps: int, p50: int, errors: int = 0) -> WrkResult:
    return WrkResult(requests=rps, duration_us=1_000_000, connect=0, read=0, write=0, status=errors, timeout=0,
                     p50_us=p50, p90_us=p50, p99_us=p50)


def test_summary_ratios_and_added_latency_are_per_round() -> None:
    ms = []
    for rnd, (direct, binary, ours) in enumerate([(50_000, 10_000, 4_000), (40_000, 5_000, 3_000)]):
        ms += [Measurement(target=DIRECT, round=rnd, load=_wrk(direct, 30), latency=_wrk(9000, 30)),
               Measurement(target="vllm-router cache_aware", round=rnd, load=_wrk(binary, 100),
                           latency=_wrk(5000, 130)),
               Measurement(target="misat misa", round=rnd, load=_wrk(ours, 300), latency=_wrk(2000, 330 + rnd),
                           cpu_s=ours * 250e-6, latency_cpu_s=2000 * (280e-6 + rnd * 20e-6))]
    rows = {t.target: t for t in summarise(ms)}
    ours = rows["misat misa"]
    assert ours.ratio_to_binary["cache_aware"].min == pytest.approx(0.4)
    assert ours.ratio_to_binary["cache_aware"].max == pytest.approx(0.6)
    assert ours.added_latency_us is not None and (ours.added_latency_us.min, ours.added_latency_us.max) == (300, 301)
    assert ours.cpu_per_request_us is not None and ours.cpu_per_request_us.median == pytest.approx(250)
    one = ours.cpu_per_request_one_conn_us  # the one-connection run's CPU over its own requests
    assert one is not None and (one.min, one.max) == (pytest.approx(280), pytest.approx(300))
    assert rows[DIRECT].cpu_per_request_one_conn_us is None
    assert ours.valid and rows[DIRECT].added_latency_us is None


def test_a_figure_with_errors_is_invalid() -> None:
    ms = [Measurement(target=DIRECT, round=0, load=_wrk(100, 30), latency=None),
          Measurement(target="misat misa", round=0, load=_wrk(100, 30, errors=1), latency=None)]
    rows = {t.target: t for t in summarise(ms)}
    assert rows[DIRECT].valid and not rows["misat misa"].valid and rows["misat misa"].errors == 1


def test_profile_split_names_the_innermost_known_frame() -> None:
    raw = "\n".join([
        "main (router/server.py:1);parse_request (router/request_meta.py:2);loads (router/json_codec.py:3) 6",
        "main (router/server.py:1);parse_request (router/request_meta.py:2) 2",
        "main (router/server.py:1);_request (aiohttp/client.py:5);<lambda> (foo.py:1) 1",
        "main (router/server.py:1);request (router/upstream.py:9) 1",
        "run (asyncio/runners.py:1) 1",
        "garbage line",
    ])
    split = profile_split(raw)
    upstream = "upstream client (aiohttp; data plane: upstream.py)"
    assert split == pytest.approx({"JSON (de)serialisation": 6 / 11, "request parsing": 2 / 11,
                                   upstream: 2 / 11, "event loop": 1 / 11})


def test_extra_router_flag() -> None:
    assert parse_extra(["before=/tmp/x:/tmp/y"]) == {"before": "/tmp/x:/tmp/y"}
    with pytest.raises(SystemExit):
        parse_extra(["/tmp/x"])
