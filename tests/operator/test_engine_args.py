"""extraArgs as vLLM reads them: every spelling of a typed flag is refused, naming the field to use;
dangerous flags are refused with the reason; what vLLM itself would refuse at start-up is refused.

The option table is vLLM 0.32.0's own (operator/vllm_flags.py, generated from its parser); the
resolver is checked against Python's argparse fed that same table, so "what vLLM would read" is
argparse's answer, not ours.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from pydantic import ValidationError

from misat_operator.engine_args import MANAGED, REFUSED, check, resolve
from misat_operator.models import describe_spec_error, parse_spec
from misat_operator.vllm_flags import ALLOW_ABBREV, FLAGS, VLLM_VERSION

TYPED_SPELLINGS = [
    (["--tensor_parallel_size", "8"], "spec.engines.tensorParallelSize"),
    (["--tensor-parallel-size=8"], "spec.engines.tensorParallelSize"),
    (["-tp", "8"], "spec.engines.tensorParallelSize"),
    (["-tp=8"], "spec.engines.tensorParallelSize"),
    (["--tensor-para", "8"], "spec.engines.tensorParallelSize"),
    (["--tensor_para=8"], "spec.engines.tensorParallelSize"),
    (["--port", "9000"], "spec.engines.port"),
    (["--host", "0.0.0.0"], "spec.engines.listenAddress"),
    (["--served-model", "x"], "spec.model.servedName"),
    (["--served_model_name=x"], "spec.model.servedName"),
    (["--model", "other"], "spec.model.name"),
    (["--max_num_seqs", "5"], "spec.engines.maxNumSeqs"),
    (["--gpu-memory-util", "0.5"], "spec.engines.gpuMemoryUtilization"),
    (["--no-enable-prefix-caching"], "spec.engines.enablePrefixCaching"),
    (["--enable-prefix"], "spec.engines.enablePrefixCaching"),
    (["--max-model-len=4096"], "spec.engines.maxModelLen"),
    (["--shutdown-timeout", "5"], "spec.engines.shutdown.drainSeconds"),
]


@pytest.mark.parametrize(("args", "field"), TYPED_SPELLINGS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_every_spelling_of_a_typed_flag_names_the_field_to_use(args: list[str], field: str) -> None:
    (problem,) = check(args)
    assert problem.index == 0
    assert f"set by the operator from {field}; set that field instead" in problem.message


DANGEROUS = [
    (["--config", "f.yaml"], "config file"),
    (["--api-key", "x"], "401"),
    (["--api_key=x"], "401"),
    (["--no-enable-prompt-tokens-details"], "prompt_tokens_details.cached_tokens"),
    (["--enable-prompt-tokens-details"], "always sets"),
    (["--disable-log-stats"], "Prometheus metrics"),
    (["--uds", "/tmp/s"], "Unix socket"),
    (["--headless"], "no API server"),
    (["--ssl-keyfile", "k.pem"], "HTTPS"),
    (["--hf-token", "hf_x"], "HF_TOKEN"),
    (["-dp", "2"], "spec.engines.replicas"),
    (["--data-parallel-size-local", "2"], "spec.engines.replicas"),
    (["-pp", "2"], "pipeline"),
    (["--help"], "exits"),
]


@pytest.mark.parametrize(("args", "reason"), DANGEROUS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_dangerous_flags_are_refused_with_the_reason(args: list[str], reason: str) -> None:
    problems = check(args)
    assert problems and problems[0].index == 0
    assert reason in problems[0].message


START_UP_REFUSALS = [
    (["--enforce-eager", "true"], 1, "stray positional"),
    (["x"], 0, "stray positional"),
    (["--enforce-eager=1"], 0, "takes no value"),
    (["--kv-cache-dtype"], 0, "expects a value"),
    (["--kv-cache-dtype", "--enforce-eager"], 0, "expects a value"),
    (["--kv-cache-dtype fp8"], 0, "holding a space"),
    (["-d", "2"], 0, "ambiguous"),
    (["--enable", "x"], 0, "ambiguous"),
    (["-tp8"], 0, "two items"),
    (["--", "x"], 0, "ends option parsing"),
]


@pytest.mark.parametrize(("args", "index", "needle"), START_UP_REFUSALS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_what_vllm_would_refuse_at_start_up_is_refused(args: list[str], index: int, needle: str) -> None:
    problems = check(args)
    assert any(p.index == index and needle in p.message for p in problems), problems


ACCEPTED = [
    ["--enforce-eager"],
    ["--kv-cache-dtype=fp8"],
    ["--kv_cache_dtype", "fp8"],
    ["--seed", "-1"],
    ["-O3"],
    ["-q", "fp8"],
    ["--compilation-config.mode", "3"],
    ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'],
    ["--enable-sleep-mode", "--trust-remote-code"],
    ["--some-future-flag", "1"],
    ["--enable-chunked-prefill", "--max-num-partial-prefills", "2"],
]


@pytest.mark.parametrize("args", ACCEPTED, ids=" ".join)
def test_harmless_flags_pass(args: list[str]) -> None:
    assert check(args) == []


def test_extra_args_problems_name_the_manifest_path() -> None:
    spec = {"model": {"name": "m"}, "workloads": [{"name": "a", "share": 100}],
            "engines": {"extraArgs": ["--enforce-eager", "-tp", "8", "--api-key", "k"]}}
    with pytest.raises(ValidationError) as err:
        parse_spec(spec)
    message = describe_spec_error(err.value)
    assert "spec.engines.extraArgs[1]: '-tp' (vLLM's --tensor-parallel-size) is set by the operator" in message
    assert "spec.engines.extraArgs[3]: --api-key is refused" in message


def test_the_flag_table_is_vllms() -> None:
    assert VLLM_VERSION == "0.32.0" and ALLOW_ABBREV is True
    assert FLAGS["-tp"] == ("tensor_parallel_size", "value")
    assert FLAGS["--no-enable-prompt-tokens-details"] == ("enable_prompt_tokens_details", "switch")
    assert FLAGS["--served-model-name"] == ("served_model_name", "values")
    assert len(FLAGS) > 400
    dests = {d for d, _ in FLAGS.values()}
    assert set(MANAGED) - {"model_tag"} <= dests
    assert set(REFUSED) <= dests, set(REFUSED) - dests


# ---- the resolver against Python's argparse, fed the same table ------------------------------


def _argparse_oracle() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=ALLOW_ABBREV, exit_on_error=False)
    by_dest: dict[str, tuple[list[str], str]] = {}
    for option, (dest, arity) in FLAGS.items():
        by_dest.setdefault(dest, ([], arity))[0].append(option)
    for dest, (options, arity) in by_dest.items():
        kwargs: dict[str, Any] = {"dest": dest, "default": None}
        if arity == "switch":
            kwargs["action"] = "store_const"
            kwargs["const"] = True
        elif arity == "values":
            kwargs["nargs"] = "+"
        elif arity == "optional":
            kwargs["nargs"] = "?"
        parser.add_argument(*sorted(options), **kwargs)
    return parser


def _vllm_normalised(args: list[str]) -> list[str]:
    """FlexibleArgumentParser's first step: underscores to dashes in long option names."""
    out = []
    for arg in args:
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            out.append(key.replace("_", "-") + eq + value)
        else:
            out.append(arg)
    return out


ORACLE_CASES = [
    ["--tensor_parallel_size", "8"], ["--tensor-para", "8"], ["-tp", "8"], ["-t", "8"], ["--served-model", "a"],
    ["--kv-cache-dt", "fp8"], ["-qfp8"], ["--max-num-b", "4096"], ["--no-enable-prefix", "--port=9000"],
    ["--enable-prompt", "--gpu-mem=0.5"], ["--enable-prompt-tok", "--gpu-mem=0.5"], ["--max_num_seqs=4"],
    ["--enforce-eager", "--api-k", "x"], ["--kv-cache-dtype", "fp8"], ["-d", "2"], ["--enable", "x"],
]


@pytest.mark.parametrize("args", ORACLE_CASES, ids=" ".join)
def test_resolver_reads_flags_as_argparse_does(args: list[str]) -> None:
    flags, problems = resolve(args)
    try:
        namespace, unknown = _argparse_oracle().parse_known_args(_vllm_normalised(args))
    except SystemExit:  # argparse refused (an ambiguous prefix): so must the resolver
        assert any("ambiguous" in p.message for p in problems), problems
        return
    assert unknown == []
    assert problems == []
    assert {f.dest for f in flags} == {d for d, v in vars(namespace).items() if v is not None}
