"""The allocator setting `misat router` applies at start."""

from __future__ import annotations

import platform

import pytest

from misat_router.memory import DEFAULT_MMAP_THRESHOLD_BYTES, pin_mmap_threshold
from misat_router.server import build_parser


def test_zero_leaves_the_allocator_alone() -> None:
    assert pin_mmap_threshold(0) is False


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_pinned_on_glibc() -> None:
    assert pin_mmap_threshold(DEFAULT_MMAP_THRESHOLD_BYTES) is True


def test_router_pins_by_default_and_can_opt_out() -> None:
    p = build_parser()
    assert p.parse_args(["--config", "c.yaml"]).malloc_mmap_threshold == DEFAULT_MMAP_THRESHOLD_BYTES
    assert p.parse_args(["--config", "c.yaml", "--malloc-mmap-threshold", "0"]).malloc_mmap_threshold == 0
