"""A GRPO + agentic rollout loop through the misa-t router, with weight updates in between.

Rollout workers run continuously (asynchronous RL):

- GRPO groups: one ``/v1/completions`` request with ``n`` samples of one token-id prompt
  (class ``rlvr``), with the sampled tokens' logprobs; each sample gets a toy reward and the
  group-relative advantage ``(r - mean) / (std + eps)``;
- agentic trajectories: a multi-turn chat loop on the official ``openai`` client (class
  ``agentic``), a simulated tool running between turns (the tool gap);
- every ``--update-interval`` seconds the trainer "publishes new weights": pause with abort,
  ``POST /collective_rpc {"method": "reload_weights"}`` on every engine through the router,
  resume with a prefix-cache reset and the new version. A sample aborted by the pause is
  resumed afterwards from its partial output (prompt + tokens so far, the next turn of the same
  session), as AReaL's partial rollouts do.

Run it against a local pool it starts (simulated engines, the manifest's router config)::

    python -P examples/trainer/grpo_agentic.py --manifest examples/mixed-pool.yaml --duration 30

or against a running router (``misat up`` prints its URL; weight updates need its admin token)::

    python -P examples/trainer/grpo_agentic.py --router http://127.0.0.1:8080 --model policy \\
        --admin-token-file token.txt

It prints one JSON report (``--out`` writes it too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from misat_client import AdminClient, AsyncRolloutSession, EngineCall, HoldRetry
from misat_client.adapters.openai_agent import OpenAIAgentLoop

GRPO_CLASS = "rlvr"
AGENT_CLASS = "agentic"
ADVANTAGE_EPS = 1e-6
"""Added to a group's reward spread, so a group of equal rewards has zero advantages."""
RELOAD_CALL = EngineCall("/collective_rpc", {"method": "reload_weights"})
"""vLLM's dev-mode RPC to every worker: reload the weights from the model path the trainer wrote."""


@dataclass
class Report:
    duration_s: float = 0.0
    groups: int = 0
    samples: int = 0
    resumed_samples: int = 0
    trajectories: int = 0
    agent_turns: int = 0
    weight_updates: int = 0
    aborted_by_updates: int = 0
    errors: int = 0
    mean_abs_advantage: float = 0.0
    final_weight_version: str | None = None


def reward(tokens: list[int]) -> float:
    """A toy verifier: the share of even token ids (any function of the sample would do)."""
    return sum(1 for t in tokens if t % 2 == 0) / len(tokens) if tokens else 0.0


def advantages(rewards: list[float]) -> list[float]:
    """GRPO's group-relative advantages."""
    mean = statistics.fmean(rewards)
    spread = statistics.pstdev(rewards)
    return [(r - mean) / (spread + ADVANTAGE_EPS) for r in rewards]


def sampled_tokens(choice: dict[str, Any]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in (choice.get("logprobs") or {}).get("tokens", [])]


async def grpo_group(router: str, model: str, prompt: list[int], args: argparse.Namespace,
                     report: Report, scores: list[float]) -> None:
    """One prompt, ``n`` samples; aborted samples resumed from their partial output."""
    sampling = {"model": model, "max_tokens": args.max_tokens, "logprobs": 0, "return_tokens_as_token_ids": True}
    async with AsyncRolloutSession(router, GRPO_CLASS, retry=HoldRetry(max_retries=args.hold_retries)) as s:
        answer = await s.completions(prompt=prompt, n=args.group_size, **sampling)
        samples = []
        for choice in sorted(answer["choices"], key=lambda c: c["index"]):
            tokens = sampled_tokens(choice)
            while choice["finish_reason"] == "abort" and len(tokens) < args.max_tokens:
                report.resumed_samples += 1
                rest = {**sampling, "max_tokens": args.max_tokens - len(tokens)}
                more = await s.completions(prompt=prompt + tokens, **rest)
                choice = more["choices"][0]
                tokens += sampled_tokens(choice)
            samples.append(tokens)
    report.groups += 1
    report.samples += len(samples)
    scores.extend(abs(a) for a in advantages([reward(t) for t in samples]))


async def simulated_tool(
    messages: list[dict[str, Any]], reply: Any, *, latency_s: float
) -> list[dict[str, Any]] | None:
    """The agent's tool: runs for ``latency_s`` (the gap between turns) and answers; the
    trajectory is done when the model stopped on its own (``finish_reason: "stop"``)."""
    if reply.choices[0].finish_reason == "stop":
        return None
    await asyncio.sleep(latency_s)  # the tool's own run time, not a synchronisation
    content = reply.choices[0].message.content or ""
    return [{"role": "user", "content": f"tool output: {len(content.split())} words"}]


async def agent_worker(loop: OpenAIAgentLoop, deadline: float, args: argparse.Namespace, report: Report) -> None:
    async def tool(messages: list[dict[str, Any]], reply: Any) -> list[dict[str, Any]] | None:
        return await simulated_tool(messages, reply, latency_s=args.tool_latency)

    while time.monotonic() < deadline:
        try:
            trajectory = await loop.run([{"role": "user", "content": "solve: t5 t6 t7"}], tool)
        except Exception as exc:
            report.errors += 1
            print(f"agent: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        report.trajectories += 1
        report.agent_turns += trajectory.turns


async def grpo_worker(router: str, model: str, worker: int, deadline: float, args: argparse.Namespace,
                      report: Report, scores: list[float]) -> None:
    i = 0
    while time.monotonic() < deadline:
        prompt = [3 + (worker * 7919 + i * 104729 + k) % 1000 for k in range(args.prompt_tokens)]
        i += 1
        try:
            await grpo_group(router, model, prompt, args, report, scores)
        except Exception as exc:
            report.errors += 1
            print(f"grpo: {type(exc).__name__}: {exc}", file=sys.stderr)


async def trainer(admin: AdminClient, deadline: float, args: argparse.Namespace, report: Report) -> None:
    version = 0
    while time.monotonic() + args.update_interval < deadline:
        await asyncio.sleep(args.update_interval)  # the "training step" between weight publications
        version += 1
        try:
            done = await admin.update_weights([RELOAD_CALL], version=str(version))
        except Exception as exc:
            report.errors += 1
            print(f"weight update: {type(exc).__name__}: {exc}", file=sys.stderr)
            with contextlib.suppress(Exception):
                await admin.resume()
            continue
        report.weight_updates += 1
        report.aborted_by_updates += done.pause.aborted_requests
        report.final_weight_version = done.resume.weight_version


async def run(router: str, model: str, admin: AdminClient | None, args: argparse.Namespace) -> Report:
    report = Report()
    scores: list[float] = []
    started = time.monotonic()
    deadline = started + args.duration
    client = AsyncOpenAI(base_url=f"{router}/v1", api_key="unused")
    loop = OpenAIAgentLoop(client, model=model, max_turns=args.max_turns,
                           sampling={"max_tokens": args.max_tokens, "logprobs": True},
                           retry=HoldRetry(max_retries=args.hold_retries))
    tasks = [grpo_worker(router, model, w, deadline, args, report, scores) for w in range(args.grpo_workers)]
    tasks += [agent_worker(loop, deadline, args, report) for _ in range(args.agents)]
    if admin is not None:
        tasks.append(trainer(admin, deadline, args, report))
    try:
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    report.duration_s = round(time.monotonic() - started, 3)
    report.mean_abs_advantage = round(statistics.fmean(scores), 4) if scores else 0.0
    return report


@contextlib.asynccontextmanager
async def target(args: argparse.Namespace) -> AsyncIterator[tuple[str, str, AdminClient | None]]:
    """The router to use: the one given, or a local pool started from the manifest."""
    if args.router:
        token = args.admin_token_file.read_text().strip() if args.admin_token_file else None
        admin = AdminClient(args.router, token) if token else None
        try:
            yield args.router.rstrip("/"), args.model, admin
        finally:
            if admin is not None:
                await admin.close()
        return
    from misat_cli.localpool import local_pool

    async with local_pool(args.manifest, time_scale=args.time_scale) as pool, \
            AdminClient(pool.router_url, pool.admin_token) as admin:
        yield pool.router_url, pool.spec.model.served, admin


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--router", help="a running router's URL (default: start a local pool from --manifest)")
    ap.add_argument("--model", default="policy", help="served model name (with --router)")
    ap.add_argument("--admin-token-file", type=Path, help="the router's admin token (with --router)")
    ap.add_argument("--manifest", type=Path, default=Path("examples/mixed-pool.yaml"))
    ap.add_argument("--time-scale", type=float, default=50.0, help="simulated seconds per wall second")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of rollouts")
    ap.add_argument("--grpo-workers", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4, help="GRPO samples per prompt (n)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--agents", type=int, default=4, help="concurrent agentic trajectories")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tool-latency", type=float, default=0.05, help="seconds a tool call takes")
    ap.add_argument("--update-interval", type=float, default=5.0, help="seconds between weight updates")
    ap.add_argument("--hold-retries", type=int, default=HoldRetry().max_retries)
    ap.add_argument("--out", type=Path, help="also write the report here")
    return ap


async def amain(args: argparse.Namespace) -> Report:
    async with target(args) as (router, model, admin):
        return await run(router, model, admin, args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = asyncio.run(amain(args))
    text = json.dumps(asdict(report), indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if report.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
