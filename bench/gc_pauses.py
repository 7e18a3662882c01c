"""Python's full garbage collections in every process of a benchmark: how often they paused
each process, and for how long.

Runs the command after ``--`` with ``bench/timeline_probe`` first on ``PYTHONPATH`` (so its
worker and producer processes load the probe too), then prints, per process, the full
collections of 1 ms or more, each at its time after the process started (``*``: after it
froze its start-up objects, ``shared.heap``). ``--root`` runs another checkout's code under
the same probe (an A/B).

    python bench/gc_pauses.py -- python bench/tenants.py --phases lone
    python bench/gc_pauses.py --root /tmp/before -- python bench/efficiency.py --shapes smc
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = Path(__file__).resolve().parent / "timeline_probe"


def summary(path: Path) -> str:
    """One process's lines: its command, then each pause (seconds after the process started:
    milliseconds, ``*`` once its start-up objects were frozen)."""
    lines = path.read_text().splitlines()
    started, _, command = lines[0].partition(" ")
    pauses = []
    for line in lines[1:]:
        at, ms, frozen = line.split()
        mark = "*" if int(frozen) else ""
        pauses.append(f"{float(at) - float(started):.1f} s: {float(ms):.0f}{mark}")
    listed = ", ".join(pauses) or "none"
    return f"{command[:90]}\n   {len(pauses)} pauses (s after start: ms): {listed}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="the checkout whose code runs")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    root = Path(args.root).resolve()
    with tempfile.TemporaryDirectory(prefix="lmpool-gc-") as tmp:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(PROBE), str(root), env.get("PYTHONPATH", "")])
        )
        env["BENCH_GC_OUT"] = str(Path(tmp) / "gc")
        done = subprocess.run(command, cwd=root, env=env)
        print(f"# full collections of 1 ms or more, per process ({root}; * = frozen by then)")
        for path in sorted(Path(tmp).glob("gc.*")):
            print(summary(path))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
