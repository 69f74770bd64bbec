"""Request parsing per request (``router/request_meta.parse_request``), timed alone.

    python -P -m misat_bench.parse_microbench [--tokens 512,24000] [--repeat 7]

Token-id completions as RL workers send them, labelled by headers (the body forwarded as
received) and by a ``rollout`` object in the body (AReaL's adapter: the router removes it and
writes the rest back). Prints the minimum over ``--repeat`` timings of each case. To compare
with another tree, run it again with that tree's packages first on ``PYTHONPATH``
(docs/scale.md); the two runs should alternate on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import random
import timeit
from collections.abc import Callable

from multidict import CIMultiDict

import misat_router
from misat_router.policy.settings import PrefixIndexSettings, WorkloadMix
from misat_router.request_meta import EndpointKind, ParsedRequest, parse_request

VOCABULARY = 150_000
"""Token ids are drawn below this (a Qwen-sized vocabulary: five- and six-digit ids)."""
MIX = WorkloadMix.model_validate({"classes": [{"name": "rlvr", "share": 100}]})
PREFIX = PrefixIndexSettings()
TARGET_S = 0.2
"""Each timing runs the case about this long."""


def case(tokens: int, body_labels: bool, rng: random.Random) -> Callable[[], ParsedRequest]:
    obj: dict[str, object] = {"model": "policy", "prompt": [rng.randrange(VOCABULARY) for _ in range(tokens)],
                              "max_tokens": 512, "temperature": 1.0}
    headers = CIMultiDict[str]()
    if body_labels:
        obj["rollout"] = {"class": "rlvr", "session_id": "s", "turn": 1}
    else:
        headers.update({"X-Rollout-Class": "rlvr", "X-Session-Id": "s", "X-Session-Turn": "1"})
    raw = json.dumps(obj).encode()
    return lambda: parse_request(raw, headers, EndpointKind.COMPLETIONS, mix=MIX, prefix=PREFIX, request_id="r")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,24000", help="prompt lengths, comma-separated")
    ap.add_argument("--repeat", type=int, default=7, help="timings per case; the minimum is printed")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    print(f"misat_router from {misat_router.__file__}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for body_labels in (False, True):
            fn = case(tokens, body_labels, rng)
            fn()
            once = timeit.timeit(fn, number=1)
            number = max(1, int(TARGET_S / max(once, 1e-7)))
            best = min(timeit.repeat(fn, number=number, repeat=args.repeat)) / number
            label = "body labels" if body_labels else "header labels"
            print(f"{tokens:>7,} ids, {label:13s} {best * 1e6:9.1f} us per request")


if __name__ == "__main__":
    main()
