"""Process-wide allocator setting for a long-running router on glibc.

glibc serves allocations of at least ``M_MMAP_THRESHOLD`` bytes with their own
mmap and gives them back on free; but each time such a block is freed it raises
the threshold to that block's size (up to 32 MiB). After a few frees, the
router's large transient blocks (the prefix index's multi-MB hash tables while
they are rebuilt, receive buffers) come from the heap instead, where the small
long-lived objects allocated after them keep the heap from shrinking: RSS climbs
in steps of a table's size under steady load. Pinning the threshold (what
``MALLOC_MMAP_THRESHOLD_`` does, at run time) keeps large blocks out of the heap.
Measured in docs/reliability.md (soak).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number for the mmap threshold (``<malloc.h>``)."""
DEFAULT_MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's own initial threshold, kept fixed instead of drifting up."""


def pin_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes``; 0 leaves glibc's dynamic threshold.

    Returns whether it was applied: False as well where the C library is not
    glibc (musl, macOS), which is logged once at INFO.
    """
    if nbytes <= 0:
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        log.info("not glibc: the allocator's mmap threshold is left as it is")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, nbytes))
