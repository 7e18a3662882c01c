"""The bench process' C heap at its fastest: freed memory kept for the next step.

The bare SMC loop (``bench/efficiency.py``) makes large short-lived buffers at every step (the
rows, the logits, a ``DynamicCache`` one position longer). glibc's malloc serves blocks above
its mmap threshold (128 KB at first) with fresh mappings and gives freed memory at the top of
the heap back to the kernel, so a step touches new pages again: one page fault per 4 KB. Kept,
the bare side took 200-450 page faults a step instead of 1,300-2,400 and ran 5-38% faster
(tiny model, 2026-11-26; docs/performance.md). The anchor is the fastest bare loop there is,
so the bench keeps freed memory in its own process (the pool's producer shares it: its page
faults were 0-150 a step either way). The worker keeps glibc's defaults: there the policy
moved neither its faults (about 2,200-2,800 a step) nor its throughput beyond the noise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("lmpool.bench")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameters (glibc's ``malloc.h``)."""
MMAP_THRESHOLD = 32 << 20
"""glibc's largest allowed mmap threshold: blocks up to 32 MB come from the heap."""
TRIM_THRESHOLD = 1 << 30
"""Freed memory at the top of the heap kept for reuse, at most (1 GiB)."""

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's malloc to reuse large freed blocks (once per process); False where the C
    library is not glibc (musl, macOS), which is left as it is."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        gnu_version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return False  # not glibc
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    gnu_version.restype = ctypes.c_char_p
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not _done:
        log.warning("glibc %s refused the heap options", gnu_version().decode())
    return _done
