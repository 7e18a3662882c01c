"""What the request path's scripts cost Redis per request, against the bare commands.

Rounds of ``--batch`` new digests (an SMC step's particles): the pool's SUBMIT call for them
(queued: each digest's checks, its waiter set, its due entry, its stream entry) and its FINISH
(each waiter set taken, a reply pushed), against the anchor: the same writes as plain commands
in one pipeline (EXISTS x2, SADD, ZADD, XADD per request; SMEMBERS, DEL, ZREM, RPUSH each
after), alternating. Printed: Redis' CPU per request (``INFO cpu``) of each, and their ratio.
No rows are moved: a row's SET and GET (``bench/rowtrip.py``) cost Redis far more.

    python bench/submit_cost.py --out bench/results/submit-cost-cpu.txt
"""

from __future__ import annotations

import argparse
import statistics
import uuid
from typing import Any

import redis
from benchkit import Report, output_args

from localpool.redis_server import RedisServer
from shared.keys import Keys
from shared.scripts import FINISH_SCRIPT, SUBMIT_SCRIPT, finish_call, submit_call

KEYS, MODEL = Keys("bench"), "m"
MESSAGE = b"x" * 120


def cpu_s(r: Any) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_sys"] + info["used_cpu_user"])


def pool_round(r: Any, digests: list[str], stream: str, reply: str) -> None:
    keys, args = submit_call(
        KEYS, MODEL, 0, stream, [(d, "0", MESSAGE) for d in digests],
        reply=reply, wait_ms=60_000, max_queue=10**9, stale_ms=15_000,
    )  # fmt: skip
    r.evalsha(SUBMIT_SCRIPT.sha, len(keys), *keys, *args)
    keys, args = finish_call(KEYS, MODEL, 0, True, 60_000, [(d, b"r" * 60) for d in digests])
    r.evalsha(FINISH_SCRIPT.sha, len(keys), *keys, *args)


def bare_round(r: Any, digests: list[str], stream: str, reply: str) -> None:
    res, wait = KEYS.digest_prefixes(MODEL, 0)
    due = KEYS.due(MODEL, 0)
    pipe = r.pipeline(transaction=False)
    for d in digests:
        pipe.exists(res + d)
        pipe.exists(wait + d)
        pipe.sadd(wait + d, reply)
        pipe.zadd(due, {f"w:{d}": 1})
        pipe.xadd(stream, {"m": MESSAGE, "d": d})
    pipe.execute()
    pipe = r.pipeline(transaction=False)
    for d in digests:
        pipe.smembers(wait + d)
        pipe.delete(wait + d)
        pipe.zrem(due, f"w:{d}")
        pipe.rpush(reply, b"r" * 60)
    pipe.execute()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="requests a round (default 64)")
    parser.add_argument("--rounds", type=int, default=1500, help="rounds a pass (default 1500)")
    parser.add_argument("--passes", type=int, default=5, help="alternating passes (default 5)")
    output_args(parser)
    args = parser.parse_args()
    report = Report(args.out, args.append)
    figures: dict[str, list[float]] = {"pool": [], "bare": []}
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        SUBMIT_SCRIPT.load_sync(r)
        FINISH_SCRIPT.load_sync(r)
        stream, reply = KEYS.stream(MODEL, "high", 0), KEYS.reply("bench")
        for _ in range(args.passes):
            for name, one in (("pool", pool_round), ("bare", bare_round)):
                before = cpu_s(r)
                for i in range(args.rounds):
                    one(r, [uuid.uuid4().hex for _ in range(args.batch)], stream, reply)
                    if i % 50 == 49:
                        r.delete(stream, reply)  # keep them small: not what is measured
                spent = cpu_s(r) - before
                figures[name].append(spent / (args.rounds * args.batch) * 1e6)
        r.close()
    report.line(f"# {args.passes} alternating passes of {args.rounds} rounds of {args.batch}")
    for name, label in (("pool", "SUBMIT + FINISH scripts"), ("bare", "anchor: bare commands")):
        runs = ", ".join(f"{v:.1f}" for v in figures[name])
        report.line(f"{label:<26} Redis CPU us/request: {runs}")
    ratio = statistics.median(figures["pool"]) / statistics.median(figures["bare"])
    report.line(f"scripts / bare (medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()
