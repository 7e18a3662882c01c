"""lm-evaluation-harness through ``--model lmpool`` (one and two workers) against lm-eval's own
``hf`` model in-process: loglikelihood requests per second, same machine, same run.

The task is a local multiple-choice task in the shape of HellaSwag (``localpool.lm_tasks``): a
context of 40-90 words and four endings of 6-14 words, written fresh each round (no cache of
either side can answer it), over the default model (the bundled SmolLM2-135M GGUF, converted;
or ``LMPOOL_MODEL``'s directory). Each round evaluates it with lm-eval's ``simple_evaluate``
through: ``hf`` (``HFLM`` in this process, ``--hf-batch-size``, float32, torch on every
core), the pool with one hf worker (every core), and the pool with two workers (one core each).
Sides alternate order from round to round. Models are loaded and connected before the clock
starts; the time is the whole ``simple_evaluate`` call. Each round also checks that lmpool's
log-likelihoods match ``hf``'s (max difference, ``is_greedy`` and accuracy equal).

Named so, not ``lm_eval.py``: this folder is first on ``sys.path`` when a bench script runs
(and on mypy's path), where a file of that name would shadow the ``lm_eval`` package.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchkit
import lm_eval
import redis
import torch
from benchkit import Report
from lm_eval.tasks import TaskManager

from localpool.lm_tasks import MC, write_tasks
from localpool.redis_server import RedisServer
from shared.keys import Keys

WORD_LIST = (
    "the a man woman child dog cat house garden river city road car door window table chair "
    "book letter phone water bread coffee music song game team player ball field morning night "
    "day week year small large old new quick slow bright dark warm cold happy quiet loud "
    "walks runs opens closes reads writes finds takes gives makes sees hears holds carries "
    "into onto under over near behind through before after while because then slowly quickly "
    "carefully again finally suddenly together alone outside inside"
)
WORDS = WORD_LIST.split()
NAME = "bench-lm-eval"


def sentence(rng: random.Random, n: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def make_docs(rng: random.Random, n: int) -> list[dict[str, Any]]:
    docs = []
    for _ in range(n):
        context = " ".join(sentence(rng, rng.randrange(8, 16)) for _ in range(rng.randrange(4, 7)))
        endings = [sentence(rng, rng.randrange(6, 15)) for _ in range(4)]
        docs.append({"question": context, "choices": endings, "answer": rng.randrange(4)})
    return docs


def evaluate(model: Any, folder: Path) -> tuple[float, dict[str, Any]]:
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=model, tasks=[MC], task_manager=manager, log_samples=True, verbosity="ERROR"
    )
    assert out is not None
    return time.perf_counter() - t0, out


def loglikelihoods(out: dict[str, Any]) -> list[tuple[float, bool]]:
    samples = sorted(out["samples"][MC], key=lambda s: s["doc_id"])
    return [(float(r[0][0]), bool(r[0][1])) for s in samples for r in s["resps"]]


def forget_results(url: str) -> None:
    """Drop the shared cache's results (a new round's task has new docs anyway)."""
    r = redis.Redis.from_url(url)
    try:
        keys = list(r.scan_iter(Keys().results(NAME), count=1000))
        if keys:
            r.delete(*keys)
    finally:
        r.close()


def start_pool(url: str, path: Path, workers: int, args: argparse.Namespace) -> list[Any]:
    threads = str(max(1, args.threads // workers))
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    started = [
        benchkit.Worker(
            url,
            extra_env=env,
            backend="hf",
            model=str(path),
            model_name=NAME,
            max_batch=args.max_batch,
            torch_threads=threads,
            log_level="WARNING",
        ).start()
        for _ in range(workers)
    ]
    for w in started:
        w.wait_ready(300)
    return started


def run(args: argparse.Namespace, report: Report) -> None:
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM

    torch.set_num_threads(args.threads)
    path = benchkit.model_dir()
    report.line(
        f"# model {path.name}, float32 on cpu, torch {torch.__version__}, lm-eval "
        f"{lm_eval.__version__}; {args.threads} torch threads in-process and per one-worker pool"
    )
    report.line(
        f"# task: {args.docs} multiple-choice docs x 4 endings = {4 * args.docs} loglikelihood "
        f"requests per round, new docs each round; {args.rounds} rounds, sides alternating"
    )
    report.line(
        f"# hf: HFLM in-process, batch_size {args.hf_batch_size}; lmpool: hf workers, max_batch "
        f"{args.max_batch}, KV cache on (default), priority low, concurrency 256"
    )
    hf = HFLM(pretrained=str(path), device="cpu", dtype="float32", batch_size=args.hf_batch_size)
    rng = random.Random(args.seed)
    rows: list[dict[str, float]] = []
    checks: list[str] = []
    with RedisServer() as one_server, RedisServer() as two_server:
        pools = {"lmpool-1": one_server.url, "lmpool-2": two_server.url}
        workers = start_pool(one_server.url, path, 1, args)
        workers += start_pool(two_server.url, path, 2, args)
        lms = {
            side: get_model("lmpool").create_from_arg_string(f"redis_url={url},model={NAME}")
            for side, url in pools.items()
        }
        try:
            with tempfile.TemporaryDirectory(prefix="lmpool-bench-tasks-") as tmp:
                warm = write_tasks(Path(tmp) / "warm", mc=make_docs(rng, 4))
                for side in ("hf", *lms):
                    evaluate(hf if side == "hf" else lms[side], warm)
                for r in range(args.rounds):
                    folder = write_tasks(Path(tmp) / f"round{r}", mc=make_docs(rng, args.docs))
                    order = ["hf", "lmpool-1", "lmpool-2"]
                    if r % 2:
                        order.reverse()
                    secs: dict[str, float] = {}
                    outs: dict[str, dict[str, Any]] = {}
                    for side in order:
                        if side != "hf":
                            forget_results(pools[side])
                        model = hf if side == "hf" else lms[side]
                        secs[side], outs[side] = evaluate(model, folder)
                    rows.append(secs)
                    ref = loglikelihoods(outs["hf"])
                    for side in lms:
                        got = loglikelihoods(outs[side])
                        diff = max(abs(a[0] - b[0]) for a, b in zip(got, ref, strict=True))
                        same = sum(a[1] == b[1] for a, b in zip(got, ref, strict=True))
                        acc = outs[side]["results"][MC]["acc,none"]
                        checks.append(
                            f"  round {r + 1} {side}: max |ll - hf ll| {diff:.2e}, is_greedy "
                            f"equal {same}/{len(ref)}, acc {acc:.3f} (hf "
                            f"{outs['hf']['results'][MC]['acc,none']:.3f})"
                        )
                    report.line(
                        f"  round {r + 1}: "
                        + ", ".join(f"{s} {secs[s]:.1f} s" for s in order)
                        + f" (load {benchkit.load_average()})"
                    )
        finally:
            for w in workers:
                w.stop()
    n = 4 * args.docs
    report.line()
    head = (
        f"{'round':>5} {'hf req/s':>9} {'1 worker':>9} {'ratio':>7} {'2 workers':>10} {'ratio':>7}"
    )
    report.line(head)
    report.line("-" * len(head))
    for r, secs in enumerate(rows, 1):
        h, one, two = n / secs["hf"], n / secs["lmpool-1"], n / secs["lmpool-2"]
        report.line(f"{r:>5} {h:>9.1f} {one:>9.1f} {one / h:>6.2f}x {two:>10.1f} {two / h:>6.2f}x")
    total = {side: sum(s[side] for s in rows) for side in rows[0]}
    h, one, two = (len(rows) * n / total[s] for s in ("hf", "lmpool-1", "lmpool-2"))
    report.line("-" * len(head))
    report.line(
        f"{'all':>5} {h:>9.1f} {one:>9.1f} {one / h:>6.2f}x {two:>10.1f} {two / h:>6.2f}x"
        "   (target: 1 worker >= 1.5x hf)"
    )
    report.line()
    report.line("check (lmpool against hf on the same docs):")
    for line in checks:
        report.line(line)
    report.line(f"# load at the end: {benchkit.load_average()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--docs", type=int, default=64, help="multiple-choice docs per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=16, help="the workers' LMPOOL_MAX_BATCH")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    benchkit.output_args(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return benchkit.run_reported_sync(run, args)


if __name__ == "__main__":
    sys.exit(main())
