"""What reopening a long ``lmpool-score`` output costs before anything is scored (a resume):
seconds and peak memory above the process before it.

A top-20 output of ``--lines`` lines (ids ``doc-N``, each line ~550 bytes) and its run record
are written to a temporary folder, then opened as a resume opens it (``Output``).

    python bench/resume_memory.py --lines 200000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time

import numpy as np

from producer.scoring.options import ScoreOptions
from producer.scoring.outputs import Output

K = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out.jsonl")
        rng = np.random.default_rng(0)
        ids = rng.integers(0, 49152, size=K).tolist()
        logprobs = sorted(rng.normal(-8, 3, size=K).tolist(), reverse=True)
        with open(out, "w") as f:
            for i in range(args.lines):
                line = {"id": f"doc-{i}", "top_ids": ids, "top_logprobs": logprobs}
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
        with open(out + ".run.json", "w") as f:
            json.dump({"model": "m", "mode": "logprobs", "top_k": K}, f)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.monotonic()
        output = Output(out, ScoreOptions(top_k=K), 49152, "m")
        seconds = time.monotonic() - started
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(
            f"{args.lines} lines ({os.path.getsize(out) / 1e6:.0f} MB): opened for a resume in "
            f"{seconds:.1f} s, peak memory +{peak / 1024:.0f} MiB, {len(output.done)} ids done"
        )
        output.close()


if __name__ == "__main__":
    main()
