"""``spec.engines.extraArgs`` read the way vLLM reads them, so a flag cannot hide behind another spelling.

vLLM's ``FlexibleArgumentParser`` (what ``vllm serve`` parses with) turns
underscores into dashes in long option names, expands ``-O3`` to
``--optimization-level 3`` and splits ``--json-arg.key value``; Python's
argparse then accepts ``--flag=value``, short aliases (``-tp 8``), a value
glued to a one-letter option (``-qfp8``) and any unambiguous prefix of a long
option (``--tensor-para 8``). ``resolve`` repeats those steps against the
option table of the pinned vLLM release (``vllm_flags.py``), so each written
argument maps to the setting vLLM would set.

On top of that, two rules (``check``):

- **typed flags win**: a setting the operator renders from a typed field
  cannot be given again in extraArgs (vLLM keeps the last value, and
  extraArgs come last); the message names the field to use;
- **dangerous flags are refused** with the reason: flags that make the
  engine unreachable to the router or its probes, blind the router's
  accounting, or leak a secret into the pod spec.

Arguments vLLM would itself refuse at start-up (a stray positional, a
switch given a value, an ambiguous prefix, a flag and its value in one
item) are refused here too, since they crash-loop the engines. A flag the
table does not know passes unchanged: another image may know it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .vllm_flags import ALLOW_ABBREV, FLAGS, VLLM_VERSION, Arity

MANAGED: dict[str, str] = {
    "model": "spec.model.name",
    "model_tag": "spec.model.name",
    "served_model_name": "spec.model.servedName",
    "host": "spec.engines.listenAddress",
    "port": "spec.engines.port",
    "tensor_parallel_size": "spec.engines.tensorParallelSize",
    "max_model_len": "spec.engines.maxModelLen",
    "gpu_memory_utilization": "spec.engines.gpuMemoryUtilization",
    "enable_prefix_caching": "spec.engines.enablePrefixCaching",
    "max_num_seqs": "spec.engines.maxNumSeqs",
    "max_num_batched_tokens": "spec.engines.maxNumBatchedTokens",
    "shutdown_timeout": "spec.engines.shutdown.drainSeconds",
}
"""vLLM setting (argparse dest) -> the typed field the operator renders it from."""

ALWAYS_SET: dict[str, str] = {
    "enable_prompt_tokens_details": (
        "the operator always sets --enable-prompt-tokens-details: the router's per-request prefix-hit "
        "accounting reads usage.prompt_tokens_details.cached_tokens, which vLLM omits without it"
    ),
}

_UNREACHABLE = "the router and the kubelet's probes reach each engine over plain HTTP on spec.engines.port"
_ONE_ENGINE = (
    "one engine pod is one engine to the router and is sized by gpusPerReplica; scale out with "
    "spec.engines.replicas"
)
REFUSED: dict[str, str] = {
    "api_key": "vLLM would answer 401 to every proxied request (the router sends no engine key) while "
    "/health, and so readiness, stays green",
    "config": "a config file can set any flag, including the ones the operator sets from typed fields, "
    "and cannot be checked here; give each flag in extraArgs",
    "help": "vLLM prints its help and exits instead of serving: the engine would crash-loop",
    "disable_log_stats": "vLLM stops exporting its Prometheus metrics, which the router's admission reads "
    "(KV usage, queue depth)",
    "hf_token": "a token in args is readable by anyone who can read the Deployment; give HF_TOKEN through "
    "spec.engines.env with valueFrom.secretKeyRef",
    "uds": f"vLLM would listen on a Unix socket and ignore host and port: {_UNREACHABLE}",
    "headless": f"a headless vLLM starts no API server: {_UNREACHABLE}",
    "grpc": f"vLLM would serve gRPC instead of HTTP on --port: {_UNREACHABLE}",
    "tokens_only": f"vLLM would serve only the tokens-in/tokens-out endpoint: {_UNREACHABLE}",
    "ssl_keyfile": f"vLLM would serve HTTPS: {_UNREACHABLE}",
    "ssl_certfile": f"vLLM would serve HTTPS: {_UNREACHABLE}",
    "ssl_ca_certs": f"vLLM would serve HTTPS: {_UNREACHABLE}",
    "ssl_cert_reqs": f"vLLM would serve HTTPS: {_UNREACHABLE}",
    "enable_ssl_refresh": f"vLLM would serve HTTPS: {_UNREACHABLE}",
    "pipeline_parallel_size": "pipeline parallelism needs tensorParallelSize x pipelineParallelSize GPUs per pod, "
    "which the operator does not size (gpusPerReplica is checked against tensorParallelSize only)",
    "nnodes": "multi-node engines are not rendered by the operator (one pod per engine)",
    "node_rank": "multi-node engines are not rendered by the operator (one pod per engine)",
}
"""Settings refused outright, with the reason; every ``data_parallel_*`` setting is refused too."""

DATA_PARALLEL_PREFIX = "data_parallel_"

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
_OPT_LEVEL = "--optimization-level"


@dataclass(frozen=True, slots=True)
class Arg:
    """One flag of extraArgs as vLLM reads it."""

    index: int
    written: str
    """The item as written (``--tensor_parallel_size=8``)."""
    option: str | None
    """vLLM's option string it resolves to (``--tensor-parallel-size``); None: not in the table."""
    dest: str | None
    """The setting it writes (``tensor_parallel_size``); None: not in the table."""


@dataclass(frozen=True, slots=True)
class Problem:
    index: int
    message: str


def _is_option(token: str) -> bool:
    """Whether argparse reads ``token`` as an option (not a value or a positional)."""
    return len(token) > 1 and token.startswith("-") and not _NEGATIVE_NUMBER.match(token)


def _long(token: str) -> tuple[str, bool, list[tuple[str, str]]]:
    """(normalised name, has an explicit value, matches) for a ``--`` token."""
    key, eq, _ = token.partition("=")
    key = key.split(".", 1)[0]  # --json-arg.key value: the flag is the part before the first '.'
    key = "--" + key[2:].replace("_", "-")
    if key in FLAGS:
        return key, bool(eq), [(key, FLAGS[key][0])]
    if not ALLOW_ABBREV:
        return key, bool(eq), []
    return key, bool(eq), [(o, FLAGS[o][0]) for o in FLAGS if o.startswith(key)]


def _short(token: str) -> tuple[str, bool, list[tuple[str, str]]]:
    """(name, has an explicit value, matches) for a single-dash token, argparse's way."""
    if token.startswith("-O"):
        return _OPT_LEVEL, len(token) > 2, [(_OPT_LEVEL, FLAGS[_OPT_LEVEL][0])]
    if token in FLAGS:
        return token, False, [(token, FLAGS[token][0])]
    key, eq, _ = token.partition("=")
    if eq and key in FLAGS:
        return key, True, [(key, FLAGS[key][0])]
    matches = []
    for option, (dest, _arity) in FLAGS.items():
        if option == token[:2]:
            matches.append((option, dest))  # a one-letter option with its value glued on: -qfp8
        elif option.startswith(token):
            matches.append((option, dest))
    glued = len(matches) == 1 and matches[0][0] == token[:2] and len(token) > 2
    return token, glued, matches


def resolve(args: list[str]) -> tuple[list[Arg], list[Problem]]:
    """Every flag in ``args`` as vLLM would read it, and what vLLM would refuse at start-up."""
    flags: list[Arg] = []
    problems: list[Problem] = []
    wants: Arity | None = None
    owner = ""
    for i, token in enumerate(args):
        if token == "--":
            problems.append(Problem(i, '"--" ends option parsing: vLLM would read every later item as a '
                                       "positional argument and refuse to start"))
            break
        if not _is_option(token):
            if wants in ("value", "optional"):
                wants = None
            elif wants == "values":
                pass
            else:
                after = f"after {owner}, which takes no value" if owner else "before any flag"
                problems.append(Problem(i, f"{token!r} is a stray positional argument ({after}): vLLM would "
                                           "refuse to start"))
            continue
        if wants == "value":
            problems.append(Problem(i - 1, f"{owner} expects a value, but the next item {token!r} is a flag"))
        _, explicit, matches = _long(token) if token.startswith("--") else _short(token)
        if not explicit and " " in token and len(matches) != 1:
            problems.append(Problem(i, f"{token!r} is one item holding a space: vLLM reads it as a stray "
                                       "positional; give the flag and its value as two items, or as flag=value"))
            wants, owner = None, ""
            continue
        dests = {dest for _, dest in matches}
        if len(dests) > 1:
            options = ", ".join(sorted(o for o, _ in matches))
            problems.append(Problem(i, f"{token!r} is ambiguous: vLLM {VLLM_VERSION} would refuse it as it "
                                       f"could match {options}"))
            wants, owner = "optional", ""  # whatever it meant, a following value would be its own
            continue
        if not matches and not token.startswith("--"):
            glued = [o for o in FLAGS if len(o) > 2 and not o.startswith("--") and token.startswith(o)]
            if glued:
                short = max(glued, key=len)
                problems.append(Problem(i, f"{token!r}: vLLM glues a value only to one-letter options and would "
                                           f"refuse this; write {short!r} and {token[len(short):]!r} as two items"))
                wants, owner = None, ""
                continue
        if not matches:
            flags.append(Arg(i, token, None, None))
            wants, owner = "optional", token  # unknown arity: a following value is the flag's
            continue
        option = min(o for o, _ in matches)
        dest = matches[0][1]
        canonical = _canonical(dest, option)
        flags.append(Arg(i, token, canonical, dest))
        arity = FLAGS[option][1] if option in FLAGS else "value"
        if arity == "switch" and explicit and option != _OPT_LEVEL:
            problems.append(Problem(i, f"{token!r}: {canonical} is a switch and takes no value"))
        wants = None if explicit or arity == "switch" else ("value" if option == _OPT_LEVEL else arity)
        owner = canonical
    if wants == "value":
        problems.append(Problem(len(args) - 1, f"{owner} expects a value"))
    return flags, problems


def _canonical(dest: str, option: str) -> str:
    """The long spelling of a setting (``-tp`` -> ``--tensor-parallel-size``); ``--no-x`` kept as is."""
    if option.startswith("--"):
        return option
    longs = sorted((o for o, (d, _) in FLAGS.items() if d == dest and o.startswith("--") and
                    not o.startswith("--no-")), key=len)
    return longs[0] if longs else option


def check(args: list[str]) -> list[Problem]:
    """Every reason ``args`` cannot be appended to the flags the operator renders (empty: fine)."""
    flags, problems = resolve(args)
    for arg in flags:
        if arg.dest is None:
            continue
        written = arg.written.split("=", 1)[0]
        subject = arg.option if written == arg.option else f"{arg.written!r} (vLLM's {arg.option})"
        if arg.dest in MANAGED:
            problems.append(Problem(arg.index, f"{subject} is set by the operator from {MANAGED[arg.dest]}; "
                                               "set that field instead"))
        elif arg.dest in ALWAYS_SET:
            problems.append(Problem(arg.index, f"{subject} cannot be given: {ALWAYS_SET[arg.dest]}"))
        elif arg.dest in REFUSED:
            problems.append(Problem(arg.index, f"{subject} is refused: {REFUSED[arg.dest]}"))
        elif arg.dest.startswith(DATA_PARALLEL_PREFIX):
            problems.append(Problem(arg.index, f"{subject} is refused: {_ONE_ENGINE}"))
    return sorted(problems, key=lambda p: p.index)
