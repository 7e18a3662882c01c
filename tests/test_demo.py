"""The demo (``make demo``) as a newcomer runs it: a process that cleans up after itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def run_demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m localpool.demo`` with its temporary folders under ``tmp_path``, on the mock
    backend (the bundled model's run is the same path, minutes slower)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPOOL_")}
    env.update(TMPDIR=str(tmp_path), LMPOOL_MODEL_NAME="mock-256")
    env.pop("VIRTUAL_ENV", None)  # as after `make demo`: the venv is not activated
    return subprocess.run(
        [sys.executable, "-m", "localpool.demo", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_demo_leaves_nothing_behind_and_says_where_the_commands_are(
    tmp_path: Path,
) -> None:
    res = run_demo(tmp_path, "--backend", "mock")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "4 prompts scored" in res.stdout
    assert list(tmp_path.iterdir()) == [], "the worker's log (and Redis' folder) are removed"
    bin_dir = Path(sys.executable).parent
    assert f"run `source {bin_dir / 'activate'}` first" in res.stdout


def test_a_failed_demo_keeps_the_worker_log_and_says_where(tmp_path: Path) -> None:
    res = run_demo(tmp_path, "--backend", "nonsense")  # the worker stops at start-up
    assert res.returncode != 0
    [folder] = tmp_path.glob("lmpool-demo-*")
    log = folder / "worker.log"
    assert "LMPOOL_BACKEND" in log.read_text()
    assert f"the demo failed; the worker's log is kept: {log}" in res.stderr
