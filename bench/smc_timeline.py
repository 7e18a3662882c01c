"""Where an SMC step's time goes in the pool: ``bench/efficiency.py``'s pool side (hf worker,
tiny model by default), every process probed (``bench/timeline_probe``, ``BENCH_SMC_TIMELINE``).

Prints the median of each stage over the steps (the first four left out): the cycle (one SUBMIT
of a step's particles to the next), the worker's step (read to answers handed to the writer),
its parts, the write, and the transport (the write's start to the step's last answer in the
producer). ``--root`` runs another checkout's code under the same probes (an A/B: stages it
lacks are left out). The probes add a few microseconds a mark.

    python bench/smc_timeline.py --steps 64
    python bench/smc_timeline.py --root /tmp/before
    python bench/smc_timeline.py --model env --device cuda --dtype bfloat16   # on a GPU

Other options go to ``bench/efficiency.py``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import benchkit

PROBES = Path(__file__).resolve().parent / "timeline_probe"
SKIP = 4
"""First steps left out (warm-up)."""


def spans(events: list[tuple[int, str]], stage: str) -> list[float]:
    """Milliseconds of each ``stage >`` .. ``stage <`` pair."""
    out, start = [], None
    for t, name in events:
        if name == f"{stage} >":
            start = t
        elif name == f"{stage} <" and start is not None:
            out.append((t - start) / 1e6)
            start = None
    return out


def transport(events: list[tuple[int, str]], particles: int) -> list[float]:
    """Milliseconds from each write's start to the ``particles``-th answer after it."""
    out = []
    for i, (t, name) in enumerate(events):
        if name != "W write >":
            continue
        answered = 0
        for t2, name2 in events[i:]:
            answered += name2 == "P request <"
            if answered == particles:
                out.append((t2 - t) / 1e6)
                break
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=benchkit.REPO, help="checkout to run")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--particles", type=int, default=64)
    args, more = parser.parse_known_args(argv)  # the rest goes to efficiency.py
    root = args.root.resolve()
    with tempfile.TemporaryDirectory(prefix="lmpool-smc-timeline-") as tmp:
        marks = Path(tmp) / "marks"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(PROBES), str(root)]),
            "BENCH_SMC_TIMELINE": str(marks),
        }
        argv_ = [
            sys.executable, str(root / "bench" / "efficiency.py"), "--shapes", "smc",
            "--rounds", "1", "--steps", str(args.steps), "--model", args.model,
            "--particles", str(args.particles), *more,
        ]  # fmt: skip
        run = subprocess.run(argv_, env=env, cwd=root, capture_output=True, text=True)
        if run.returncode:
            sys.stderr.write(run.stdout + run.stderr)
            return run.returncode
        events = sorted(
            (int(t), name)
            for path in Path(tmp).glob("marks.*")
            for t, name in (line.rstrip("\n").split(" ", 1) for line in path.open())
        )
    summary = [
        line
        for line in run.stdout.splitlines()
        if line.startswith(("SMC", "   per", "   ready", "   the rows"))
    ]
    shown = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"$ python bench/smc_timeline.py {shown}  # code at {root}")
    print(*summary, sep="\n")
    submits = [t for t, name in events if name == "P submit >"]
    rows = {
        "cycle (SUBMIT to SUBMIT)": [(b - a) / 1e6 for a, b in itertools.pairwise(submits)],
        "worker: decode + validate": spans(events, "W decode"),
        "worker: step (to answers handed over)": spans(events, "W step"),
        "  forward (KV plan, gather, model)": spans(events, "W forward"),
        "  KV store (after the write, if deferred)": spans(events, "W KV store"),
        "  encode the rows": spans(events, "W encode"),
        "worker: write to Redis": spans(events, "W write"),
        "transport (write start to last answer)": transport(events, args.particles),
    }
    print(f"{'stage':<44} {'median ms':>10} {'steps':>6}")
    for name, values in rows.items():
        if len(values) > SKIP:
            print(f"{name:<44} {statistics.median(values[SKIP:]):>10.2f} {len(values):>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
