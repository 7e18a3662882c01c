"""The pool against the bare engine on the same model, in the same run: what the pool costs.

The bare engine is the fastest loop that does the same work in one process, with no pool:
transformers with a KV cache, every row's full ``log_softmax`` copied out to the CPU, the
particles' tokens drawn by one batched inverse-CDF draw (``draw``). Two workload shapes:

- **SMC**: N particles share a prompt; each step every particle needs the next-token row of
  its own prefix, one token longer than the last; every 4th step (``--resample-every``) the
  particles are resampled (some duplicated, some dropped), survivors in index order, or in the
  order drawn with ``--shuffled`` (as ``numpy.random.choice`` hands them out: duplicates
  scattered over the batch). Bare: the prompt prefilled once, then one batched decode
  step of all particles per step, the cache rows gathered on resampling (``index_select``).
  Pool: the same loop through ``RemoteLM.next_token_logprobs``, one hf worker, KV cache on.
- **genlm** (genlm-backend's favourite case): P prompts = a shared prefix + 8 distinct tokens,
  a new prefix each set. Bare: the prefix prefilled once, its cache repeated over P rows, one
  forward of the 8 new tokens. Pool: ``batch_next_token_logprobs`` with no ``cache_kv`` hint.

Rows per second on each side and the ratio pool / bare, beside the targets of the issue. Two
anchors beside the SMC figure: the model's floor (a step's new tokens with no past), and the
rows' round trip alone (``bench/rowtrip.py``: the same bytes into the same Redis and back on one
raw socket, after each bare round): the bare step plus that round trip is as fast as any pool
that moves its rows through Redis can be, so ``bare step / (bare step + round trip)`` is the
ratio such a pool reaches at most on the machine at hand.

    python bench/efficiency.py                                # tiny model, both shapes
    python bench/efficiency.py --model default --particles 16 --steps 8
    LMPOOL_MODEL=DIR python bench/efficiency.py --model env --device cuda --dtype bfloat16
    .venv-vllm/bin/python bench/efficiency.py --backend vllm --model tiny-hd32  # on vLLM

``--model tiny`` writes a random Llama of ``bench/random_model.py``'s ``tiny`` shape (hidden
64, 2 layers, SmolLM2's tokenizer: V = 49,152) to a temporary folder: its forward pass is cheap
next to the LM head and the rows, as on a GPU, so the pool's own work shows.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import benchkit
import random_model
import redis
import torch
from rowtrip import RowTrip

from shared.heap import freeze_start_up_objects, keep_freed_memory
from shared.keys import Keys
from shared.protocol import sent_dtype

KEYS = Keys()
VOCAB = 49_152
"""SmolLM2's vocabulary (the tiny and default models): a row's size, for the cache's filler."""


# -- the workload, shared by both sides --------------------------------------------------------
def resample(rng: random.Random, n: int, shuffled: bool) -> list[int]:
    """Which particles survive a resampling step (with duplicates), in index order unless
    ``shuffled``."""
    drawn = rng.choices(range(n), k=n)
    return drawn if shuffled else sorted(drawn)


def resampling(step: int, args: argparse.Namespace) -> bool:
    """Whether the particles are resampled after ``step`` (then every ``resample_every``)."""
    return (step + 2) % args.resample_every == 0


def prompt_ids(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(1000, 40000), k=n)


# -- bare engine ---------------------------------------------------------------------------
def load_model(path: Path, device: str, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    if device == "cuda":
        # As the hf worker does (worker/backends/hf/backend.py): cuDNN's attention builds a plan
        # per new shape, and the KV length grows every step; left on, it slows the bare side.
        torch.backends.cuda.enable_cudnn_sdp(False)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bare_smc(model: Any, args: argparse.Namespace, seed: int) -> tuple[int, float]:
    """(rows, seconds) of the SMC loop in one process with a KV cache."""
    device = args.device
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    prompt = torch.tensor([prompt_ids(seed, args.prompt_tokens)], device=device)
    n = args.particles
    rows_out = 0
    sync(device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)
        rows = torch.log_softmax(out.logits[:, -1].float(), -1).expand(n, -1).cpu()
        rows_out += n
        for step in range(args.steps - 1):
            tokens = torch.tensor(benchkit.draw(rows, gen), device=device)[:, None]
            out = model(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=1)
            rows = torch.log_softmax(out.logits[:, -1].float(), -1).cpu()
            rows_out += n
            if resampling(step, args):
                keep = torch.tensor(resample(rng, n, args.shuffled), device=device)
                cache.reorder_cache(keep)
                rows = rows[keep.cpu()]
    sync(device)
    return rows_out, time.perf_counter() - started


def forward_floor(model: Any, args: argparse.Namespace, repeats: int = 5) -> float:
    """Seconds of the least an SMC step's forward can cost at this model and thread count: the
    particles' new tokens through the layers and the LM head with no past to attend (median of
    ``repeats``). No engine's step, bare or pooled, gets below it."""
    tokens = torch.tensor(prompt_ids(args.seed + 11, args.particles), device=args.device)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first warms up
            sync(args.device)
            started = time.perf_counter()
            model(input_ids=tokens[:, None], use_cache=False, logits_to_keep=1)
            sync(args.device)
            times.append(time.perf_counter() - started)
    return sorted(times[1:])[repeats // 2]


def genlm_sets(args: argparse.Namespace) -> list[tuple[list[int], list[list[int]]]]:
    """One untimed set, then ``--sets`` timed ones: (prefix, prompts), a new prefix each."""
    rng = random.Random(args.seed + 99)
    out = []
    for _ in range(args.sets + 1):
        prefix = rng.choices(range(1000, 40000), k=args.prompt_tokens)
        out.append((prefix, [prefix + rng.choices(range(1000, 40000), k=8) for _ in range(64)]))
    return out


def bare_genlm(model: Any, args: argparse.Namespace) -> tuple[int, float]:
    """(rows, seconds) of the timed sets: prefix once, then its 64 suffixes in one forward."""
    sets = genlm_sets(args)
    rows_out, seconds = 0, 0.0
    for i, (prefix, prompts) in enumerate(sets):
        sync(args.device)
        started = time.perf_counter()
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([prefix], device=args.device), use_cache=True)
            cache = out.past_key_values
            cache.batch_repeat_interleave(len(prompts))
            suffixes = torch.tensor([p[len(prefix) :] for p in prompts], device=args.device)
            out = model(input_ids=suffixes, past_key_values=cache, logits_to_keep=1)
            torch.log_softmax(out.logits[:, -1].float(), -1).cpu()
        sync(args.device)
        if i:
            rows_out += len(prompts)
            seconds += time.perf_counter() - started
    return rows_out, seconds


# -- pool ----------------------------------------------------------------------------------
async def pool_smc(lm: Any, args: argparse.Namespace, seed: int) -> tuple[int, float]:
    """(rows, seconds) of the same SMC loop through ``lm``."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    n = args.particles
    seqs = [prompt_ids(seed, args.prompt_tokens) for _ in range(n)]
    rows_out = 0
    started = time.perf_counter()
    for step in range(args.steps):
        rows = torch.stack(await asyncio.gather(*(lm.next_token_logprobs(s) for s in seqs)))
        rows_out += n
        if step == args.steps - 1:
            break
        seqs = [[*s, t] for s, t in zip(seqs, benchkit.draw(rows, gen), strict=True)]
        if resampling(step, args):
            seqs = [list(seqs[i]) for i in resample(rng, n, args.shuffled)]
    return rows_out, time.perf_counter() - started


async def pool_genlm(lm: Any, args: argparse.Namespace) -> tuple[int, float]:
    rows_out, seconds = 0, 0.0
    for i, (_, prompts) in enumerate(genlm_sets(args)):
        started = time.perf_counter()
        await lm.batch_next_token_logprobs(prompts)
        if i:
            rows_out += len(prompts)
            seconds += time.perf_counter() - started
    return rows_out, seconds


async def pool_side(
    url: str, path: Path, args: argparse.Namespace, kv_cache_mb: int | None
) -> dict[str, Any]:
    """One fresh worker (KV cache on unless ``kv_cache_mb == 0``) and the selected shapes, on
    a Redis holding none of the pool's keys (the cache's filler stays)."""
    with redis.Redis.from_url(url) as r:
        for key in r.scan_iter(KEYS.everything_pattern(), count=1000):
            r.unlink(key)
    settings: dict[str, Any] = {"kv_cache_mb": kv_cache_mb} if kv_cache_mb is not None else {}
    settings.update(args.cache_settings)
    if args.wire_dtype != "float32":  # the default: not naming it lets this script run older code
        settings["wire_dtype"] = args.wire_dtype
    if args.backend != "hf":  # an engine fills the GPU up to its share: room for the bare side
        settings["gpu_memory_utilization"] = 0.6
    worker = benchkit.Worker(
        url,
        extra_env={"OMP_NUM_THREADS": str(args.threads)},
        backend=args.backend,
        model=str(path),
        model_name="efficiency",
        device=args.device,
        dtype=args.dtype,
        torch_threads=args.threads,
        keep_freed_memory=args.heap == "kept",
        max_batch=max(64, args.particles),
        heartbeat_s=0.5,  # the KV counters, read after two heartbeats
        log_level="WARNING",
        **settings,
    ).start()
    out: dict[str, Any] = {}
    try:
        more = {} if args.heap == "kept" else {"keep_freed_memory": False}
        lm = await benchkit.connect_remote_lm(worker, url, "efficiency", 600, 3600, **more)
        try:
            await pool_smc(lm, argparse.Namespace(**{**vars(args), "steps": 2}), args.seed + 7)
            if "smc" in args.shapes:
                out["smc"], out["cpu"], out["wait"], out["faults"] = await profiled(
                    worker, url, args, pool_smc(lm, args, args.seed)
                )
            if "genlm" in args.shapes:
                out["genlm"] = await pool_genlm(lm, args)
        finally:
            await lm.close()
        await asyncio.sleep(1.0)  # two heartbeats: the KV counters are final
        out["kv"] = benchkit.kv_totals(url)
    finally:
        worker.stop()
    return out


async def profiled(
    worker: benchkit.Worker, url: str, args: argparse.Namespace, run: Any
) -> tuple[Any, dict[str, float], dict[str, float], tuple[int, int]]:
    """``await run``, the CPU seconds that the producer (this process), the worker and Redis
    used meanwhile, the seconds each waited for a core, and the page faults of the first two;
    with ``--profile``, the worker sampled by py-spy too (printed after the run: where its busy
    time went, by frame, own and inclusive)."""
    assert worker.proc is not None
    pid = worker.proc.pid
    with redis.Redis.from_url(url) as r:
        r.config_resetstat()
    faults = (benchkit.process_faults(), benchkit.process_faults(pid))
    pids = (None, pid, benchkit.redis_pid(url))
    waits = [benchkit.process_wait_s(p) for p in pids]
    before = (time.process_time(), benchkit.process_cpu_s(pid), benchkit.redis_cpu_s(url))
    if args.profile:
        out = Path(tempfile.mkdtemp(prefix="lmpool-efficiency-")) / "worker.pyspy.txt"
        with benchkit.py_spy(pid, out):
            result = await run
        args.profiles.append(out)
    else:
        result = await run
    after = (time.process_time(), benchkit.process_cpu_s(pid), benchkit.redis_cpu_s(url))
    waits = [benchkit.process_wait_s(p) - w for p, w in zip(pids, waits, strict=True)]
    names = ("producer", "worker", "redis")
    with redis.Redis.from_url(url) as r:
        stats = benchkit.commandstats(r)
    args.commandstats.append({name: usec / 1e6 for name, (_, usec) in stats.items()})
    cpu = {n: b - a for n, a, b in zip(names, before, after, strict=True)}
    return (
        result,
        cpu,
        dict(zip(names, waits, strict=True)),
        (benchkit.process_faults() - faults[0], benchkit.process_faults(pid) - faults[1]),
    )


def print_profile(path: Path, report: benchkit.Report, top: int = 30) -> None:
    for inclusive in (False, True):
        what = "inclusive (the frame and below)" if inclusive else "own time (leaf frames)"
        report.line(f"## worker, py-spy, share of busy samples: {what}; raw: {path}")
        for frame, share in benchkit.folded_shares(path, top, inclusive):
            report.line(f"{100 * share:>6.1f}%  {frame}")


def rate(rows_seconds: tuple[int, float]) -> float:
    rows, seconds = rows_seconds
    return rows / seconds


async def run(args: argparse.Namespace, report: benchkit.Report) -> None:
    torch.set_num_threads(args.threads)
    # as RemoteLM.connect does by default (shared.heap), before the bare side's first round
    # too: the bare loop runs faster so
    kept = args.heap == "kept" and keep_freed_memory()
    if args.heap == "default":  # the Redis started below too (shared.heap.server_environment)
        os.environ["GLIBC_TUNABLES"] = ""
    report.line(
        f"# C heap of this process (bare side and producer), the worker's and Redis': freed "
        f"memory {'kept for reuse' if kept else 'given back'} (--heap {args.heap})"
    )
    with tempfile.TemporaryDirectory(prefix="lmpool-efficiency-") as tmp:
        if args.model in ("tiny", "tiny-hd32"):
            path = random_model.build(
                Path(tmp), args.model, random_model.default_tokenizer_dir(), torch.float32, 0
            )
        elif args.model == "default":
            path = benchkit.model_dir()
        else:
            path = Path(args.model) if args.model != "env" else benchkit.model_dir()
        report.line(
            f"# model {args.model} ({path.name}), {args.dtype} on {args.device}"
            f"{benchkit.device_name(args.device)}, torch {torch.__version__}, "
            f"{args.threads} torch thread(s) each side; pool backend {args.backend}, "
            f"rows on the wire in {args.wire_dtype}"
        )
        model = load_model(path, args.device, args.dtype)
        bare_smc(model, argparse.Namespace(**{**vars(args), "steps": 2}), args.seed + 7)  # warm-up
        floor_s = forward_floor(model, args)
        if args.gc == "frozen":
            # this process' start-up objects (torch, transformers, the model) out of Python's
            # full collections, as a worker's (shared.heap): each paused the process 184-240 ms,
            # once a run, in whichever side was timed then
            report.line(f"# this process' {freeze_start_up_objects()} start-up objects frozen")
        bare: dict[str, tuple[int, float]] = {}
        with benchkit.cache_redis(args, report, 4 * VOCAB) as (server, args.cache_settings):
            # bare and pool alternate, so that a slow spell of the machine hits both
            pools: list[dict[str, Any]] = []
            offs: list[dict[str, Any]] = []
            # the rows' round trip alone, after each bare round (rows of the same shape and
            # wire dtype: their values do not change what moving them costs)
            url = server.unix_url if args.unix_socket else server.url
            trip = RowTrip(url, server.port, server.unix_path if args.unix_socket else None)
            model_dtype = getattr(torch, args.dtype)
            sent = sent_dtype(model_dtype, getattr(torch, args.wire_dtype)) or model_dtype
            trip_rows = torch.randn(args.particles, VOCAB).log_softmax(-1).to(sent)
            trips: list[tuple[float, float, float]] = []
            for _ in range(args.rounds):
                if "smc" in args.shapes:
                    faults, waited = benchkit.process_faults(), benchkit.process_wait_s()
                    r, s = bare_smc(model, args, args.seed)
                    args.bare_faults += benchkit.process_faults() - faults
                    args.bare_wait_s += benchkit.process_wait_s() - waited
                    prev = bare.get("smc", (0, 0.0))
                    bare["smc"] = (prev[0] + r, prev[1] + s)
                    trips.append(trip.measure(trip_rows, 16))
                if "genlm" in args.shapes:
                    r, s = bare_genlm(model, args)
                    prev = bare.get("genlm", (0, 0.0))
                    bare["genlm"] = (prev[0] + r, prev[1] + s)
                pools.append(await pool_side(url, path, args, None))
                if args.kv_off and "smc" in args.shapes:
                    offs.append(await pool_side(url, path, args, 0))
            trip.close()
        del model

    def total(sides: list[dict[str, Any]], shape: str) -> tuple[int, float]:
        return (sum(p[shape][0] for p in sides), sum(p[shape][1] for p in sides))

    for path in args.profiles:
        print_profile(path, report)
    p = f"{args.particles} particles, {args.prompt_tokens}-token prompt, {args.steps} steps"
    if "smc" in args.shapes:
        b, pl = rate(bare["smc"]), rate(total(pools, "smc"))
        kv = pools[-1]["kv"]
        if kv.get("tokens_requested"):
            hit = kv.get("tokens_reused", 0) / kv["tokens_requested"]
            counters = f"KV hit rate {hit:.3f}, forward passes {kv.get('forward_passes', 0)}"
        else:  # vLLM keeps its prefix cache to itself
            counters = f"no KV counters from the {args.backend} worker"
        report.line(
            f"SMC ({p}, resampled every {args.resample_every}"
            f"{', survivors shuffled' if args.shuffled else ''}, x{args.rounds}): "
            f"bare {b:.1f} rows/s, pool (KV on) {pl:.1f} rows/s = "
            f"{pl / b:.2f}x bare (target >= 0.5x); {counters}"
        )
        steps = args.steps * args.rounds
        cpu = {n: sum(p["cpu"][n] for p in pools) for n in pools[0]["cpu"]}
        report.line(
            f"   per step, wall {1000 * total(pools, 'smc')[1] / steps:.1f} ms (bare "
            f"{1000 * bare['smc'][1] / steps:.1f}); CPU: "
            + ", ".join(f"{n} {1000 * c / steps:.1f} ms" for n, c in cpu.items())
        )
        wait = {n: sum(p["wait"][n] for p in pools) for n in pools[0]["wait"]}
        report.line(
            "   ready but waiting for a core (the run queue), per step: "
            + ", ".join(f"{n} {1000 * w / steps:.1f} ms" for n, w in wait.items())
            + f" (bare {1000 * args.bare_wait_s / steps:.1f} ms)"
        )
        per_step = [sum(p["faults"][i] for p in pools) / steps for i in (0, 1)]
        report.line(
            f"   minor page faults per step: producer {per_step[0]:.0f}, worker {per_step[1]:.0f} "
            f"(bare {args.bare_faults / steps:.0f})"
        )
        top = sorted(args.commandstats[-1].items(), key=lambda kv: -kv[1])[:6]
        report.line(
            "   Redis commands' own time per step (last round): "
            + ", ".join(f"{n} {1000 * t / args.steps:.2f} ms" for n, t in top)
        )
        set_s, get_s, redis_s = (statistics.median(t[i] for t in trips) for i in range(3))
        bare_step = bare["smc"][1] / steps
        anchored = bare_step + set_s + get_s
        report.line(
            f"   the rows' round trip alone (bench/rowtrip.py: one raw socket, {args.particles} "
            f"SETs then GETs into place, medians of 16 trips a round): SET {1000 * set_s:.1f} "
            f"ms, GET {1000 * get_s:.1f} ms, Redis' CPU {1000 * redis_s:.1f} ms; bare step + it "
            f"{1000 * anchored:.1f} ms = {bare_step / anchored:.2f}x bare at most for a pool that "
            f"moves its rows through Redis; pool / that {pl * anchored / args.particles:.2f}x"
        )
        report.line(
            f"   floor: {args.particles} new tokens through the model, no past, "
            f"{1000 * floor_s:.1f} ms a step = {args.particles / floor_s:.0f} rows/s at most for "
            f"any engine; pool / floor {pl * floor_s / args.particles:.2f}x"
        )
        if offs:
            off = rate(total(offs, "smc"))
            report.line(
                f"   pool KV off {off:.1f} rows/s; KV on / off = {pl / off:.2f}x (target >= 1x)"
            )
    if "genlm" in args.shapes:
        b, pl = rate(bare["genlm"]), rate(total(pools, "genlm"))
        report.line(
            f"genlm (64 prompts = {args.prompt_tokens}-token prefix + 8, {args.sets} sets after "
            f"one untimed, x{args.rounds}): bare {b:.1f} rows/s, pool {pl:.1f} rows/s = "
            f"{pl / b:.2f}x bare"
        )


def workload_args(parser: argparse.ArgumentParser) -> None:
    """The SMC workload's options (``pool_smc`` reads them), for this bench and others that run
    the same loop (``bench/worker_memory.py``)."""
    parser.add_argument("--particles", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--resample-every", type=int, default=4, help="SMC: steps a resampling")
    parser.add_argument(
        "--shuffled", action="store_true", help="SMC: survivors in the order drawn, not sorted"
    )
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="tiny",
        help="tiny or tiny-hd32 (random, built here; vLLM on the CPU needs the second), "
        "default, env, or a folder",
    )
    parser.add_argument("--backend", choices=("hf", "vllm", "sglang"), default="hf")
    parser.add_argument("--shapes", default="smc,genlm", help="smc, genlm or both")
    workload_args(parser)
    parser.add_argument("--sets", type=int, default=3, help="timed prompt sets of the genlm shape")
    parser.add_argument("--rounds", type=int, default=2, help="bare and pool alternate this often")
    parser.add_argument("--kv-off", action="store_true", help="also the pool with its KV cache off")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--wire-dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="the pool's LMPOOL_WIRE_DTYPE",
    )
    parser.add_argument(
        "--gc",
        choices=("frozen", "default"),
        default="frozen",
        help="this process' start-up objects frozen before the timed runs (shared.heap; a "
        "worker's always are), or Python's collector left as it is",
    )
    parser.add_argument(
        "--heap",
        choices=("kept", "default"),
        default="kept",
        help="the C heap of this process, the worker and Redis: freed memory kept (shared.heap; "
        "the default of RemoteLM, workers and the Redis servers lmpool starts) or glibc's "
        "defaults (LMPOOL_KEEP_FREED_MEMORY=0, GLIBC_TUNABLES='')",
    )
    parser.add_argument(
        "--profile", action="store_true", help="py-spy the worker during the pool's SMC runs"
    )
    benchkit.cache_args(parser)
    benchkit.redis_placement_args(parser)
    benchkit.output_args(parser)
    args = parser.parse_args(argv)
    args.profiles = []
    args.commandstats = []
    args.bare_faults = 0
    args.bare_wait_s = 0.0
    return benchkit.run_reported(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
