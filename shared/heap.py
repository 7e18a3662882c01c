"""The C heap of a process: freed memory kept for the next step (producers), or given back
(workers).

An SMC step hands the caller 64 rows of 196 KB (SmolLM2's vocabulary in float32), each
received into a buffer of its own, and the caller's own work on them (a draw, a stack) makes
more of the same size; a few milliseconds later all of it is freed. glibc's malloc serves blocks
above its mmap threshold (128 KB at first) with fresh mappings and gives freed memory at the
top of the heap back to the kernel, so the next step touches new pages again: one page fault
per 4 KB, 950-2,500 a step in the producer of ``bench/efficiency.py``. With freed memory kept
the same producer took 40-140 and the pool ran 6-17% faster; the bare loop in that process
(the bench's anchor) 20-28% faster (docs/performance.md).

:func:`keep_freed_memory` sets glibc's options so that blocks up to ``MMAP_THRESHOLD`` come
from the heap and up to ``TRIM_THRESHOLD`` of freed memory stays with the process: its resident
memory then stays near its peak instead of shrinking between steps. ``RemoteLM`` calls it when
it connects, unless ``LMPOOL_KEEP_FREED_MEMORY=0``. Workers keep glibc's defaults: there it
moved neither their page faults nor their throughput beyond the noise.

A worker has the opposite trouble. Its compute thread makes a step's rows and the event loop's
thread frees them once written, and glibc's arenas kept growing with that: 33 MiB of resident
memory a run of ``bench/worker_memory.py`` (64 particles, 32 steps), 1.1 GB after 20 runs and
rising, where the same rows freed in the thread that made them left it flat.
:func:`give_back_freed_memory` (``malloc_trim``) returns what the arenas hold free to the
system; the worker calls it each heartbeat (1-10 ms, off the event loop).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

log = logging.getLogger("lmpool")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameters (glibc's ``malloc.h``)."""
MMAP_THRESHOLD = 32 << 20
"""glibc's largest allowed mmap threshold: blocks up to 32 MB come from the heap."""
TRIM_THRESHOLD = 1 << 30
"""Freed memory at the top of the heap kept for reuse, at most (1 GiB)."""

_done: bool | None = None


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (it has ``mallopt`` and ``malloc_trim``), else None;
    looked up once."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        for name in ("mallopt", "malloc_trim", "gnu_get_libc_version"):
            getattr(libc, name)
    except (OSError, AttributeError):
        return None  # not glibc
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


def give_back_freed_memory() -> bool:
    """Return the free memory of every malloc arena to the system (``malloc_trim(0)``); True
    if any was, False also where the C library is not glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


def keep_freed_memory() -> bool:
    """Set glibc's malloc to reuse large freed blocks (once per process); False where the C
    library is not glibc (musl, macOS), which is left as it is."""
    global _done
    if _done is not None:
        return _done
    _done = False
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    gnu_version = libc.gnu_get_libc_version
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    gnu_version.restype = ctypes.c_char_p
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not _done:
        log.warning("glibc %s refused the heap options", gnu_version().decode())
    return _done
