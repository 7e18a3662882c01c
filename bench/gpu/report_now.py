"""A pytest plugin for run.sh: each failing test's report is written to ``$LMGPU_FAILURES`` the
moment the test fails, not at the end of the session. A step that its timeout cuts (a vLLM
engine still starting, say) kills pytest before its summary: the failures before the cut still
say which assertion failed and by how much.

    PYTHONPATH=bench/gpu:$PYTHONPATH LMGPU_FAILURES=out/failures.txt python3 -m pytest -p report_now
"""

from __future__ import annotations

import os
import time

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("LMGPU_FAILURES")
    if not path or not report.failed:
        return
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"=== {stamp}Z {report.nodeid} ({report.when}, {report.duration:.1f} s)\n")
        f.write(report.longreprtext.rstrip() + "\n")
        for name, text in report.sections:
            if text.strip():
                f.write(f"--- {name}\n{text.rstrip()}\n")
        f.write("\n")
