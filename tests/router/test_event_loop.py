"""`misat router --event-loop`: uvloop by default, the stdlib loop on request."""

from __future__ import annotations

import asyncio

import uvloop

from misat_router.server import build_parser, event_loop_factory


def test_default_is_uvloop_and_asyncio_turns_it_off() -> None:
    args = build_parser().parse_args(["--config", "c.yaml"])
    assert args.event_loop == "uvloop"
    factory = event_loop_factory(args.event_loop)
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
    off = build_parser().parse_args(["--config", "c.yaml", "--event-loop", "asyncio"])
    assert event_loop_factory(off.event_loop) is None
    with asyncio.Runner(loop_factory=event_loop_factory(off.event_loop)) as r:
        assert not isinstance(r.get_loop(), uvloop.Loop)
