"""bench/gpu/report_now.py: a failure's report is on disk before pytest is killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_failure_is_written_before_the_session_is_cut(tmp_path: Path) -> None:
    (tmp_path / "test_cut.py").write_text(
        "import time\n"
        "def measured():\n    return 0.012\n"
        "def test_fails():\n    assert measured() < 1e-2\n"
        "def test_passes():\n    pass\n"
        "def test_hangs():\n    time.sleep(60)\n"
    )
    failures = tmp_path / "failures.txt"
    env = {
        **os.environ,
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "LMGPU_FAILURES": str(failures),
        "PYTHONPATH": str(REPO / "bench" / "gpu"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "report_now", "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not failures.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
    finally:
        proc.kill()  # as run.sh's timeout does: no end-of-session summary
        proc.wait()
    text = failures.read_text()
    assert "test_cut.py::test_fails (call" in text
    assert "assert 0.012 < 0.01" in text
    assert "test_passes" not in text and "test_hangs" not in text
