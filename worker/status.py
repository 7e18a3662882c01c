"""``python -m worker.status`` (also ``lmpool-status``): what the pool is doing, per model.

Live workers (host, backend, device, batch size, heartbeat age, requests/s), queue lengths and
pending counts per stream, the shared-cache and KV hit rates, per-tenant counters, tenants'
quotas and their use, dead letters and offline jobs.
``--watch N`` refreshes every N seconds; ``--json`` prints the same data for machines.
``--forget MODEL`` takes a model no live worker serves off the list.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any, cast

from redis.asyncio.cluster import RedisCluster
from redis.connection import parse_url
from redis.exceptions import RedisError

from shared import registry
from shared.errors import PoolUnreachable, SettingsError
from shared.keys import GROUP, Keys
from shared.redis_conn import (
    AnyRedis,
    check_url,
    connect_redis,
    masked_url,
    probe,
    reaching,
)
from shared.settings import Settings
from worker.quota import read_quotas
from worker.quota import render as render_quotas
from worker.stream.consumer import NO_TENANT
from worker.stream.tenants import read_tenants


class Refused(Exception):
    """What the operator asked for cannot be done (the message says why)."""


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def collect(redis: AnyRedis, keys: Keys) -> dict[str, Any]:
    """Everything the status view shows, as plain data."""
    models = sorted(_s(m) for m in await redis.smembers(keys.models))  # type: ignore[misc]
    out: dict[str, Any] = {"time": time.time(), "models": {}, "jobs": await _jobs(redis, keys)}
    out["quotas"] = await read_quotas(redis, keys)
    try:
        out["redis"] = await redis_memory(redis)
    except RedisError:  # INFO refused (an ACL user without it): no memory line
        out["redis"] = {}
    for model in models:
        out["models"][model] = await _model(redis, keys, model)
    return out


async def redis_memory(redis: AnyRedis) -> dict[str, Any]:
    """Redis' memory (on a cluster, its primary nearest its cap): bytes used, ``maxmemory``
    (0: no cap), ``maxmemory_policy``, keys evicted and commands refused for want of memory
    (``OOM``) since it started, and ``full``: above its cap now, so that it refuses writes
    (it evicts before each command what its policy lets it: nothing was left to evict)."""
    nodes: dict[str, dict[str, Any]] = {}
    for section in ("memory", "stats", "errorstats"):
        if isinstance(redis, RedisCluster):
            got = await redis.info(section, target_nodes=RedisCluster.PRIMARIES)
        else:
            got = {"": await redis.info(section)}
        for node, info in got.items():
            nodes.setdefault(node, {}).update(info)

    def view(i: dict[str, Any]) -> dict[str, Any]:
        used, cap = int(i.get("used_memory", 0)), int(i.get("maxmemory", 0))
        oom = i.get("errorstat_OOM")
        return {
            "used_memory": used, "maxmemory": cap, "maxmemory_policy": i.get("maxmemory_policy"),
            "evicted_keys": int(i.get("evicted_keys", 0)), "full": bool(cap) and used > cap,
            "refused_oom": int(oom["count"]) if isinstance(oom, dict) else 0,
        }  # fmt: skip

    views = [view(i) for i in nodes.values()]
    return max(views, key=lambda v: (v["full"], v["used_memory"] / (v["maxmemory"] or 1 << 62)))


async def _model(redis: AnyRedis, keys: Keys, model: str) -> dict[str, Any]:
    workers = []
    for wid in await registry.live_workers(redis, keys, model):
        info = await registry.worker_info(redis, keys, wid)
        if info:
            info["id"] = wid
            workers.append(info)
    meta = await registry.read_meta(redis, keys, model)
    streams = {}
    shards = meta["shards"] if meta is not None else 1
    tenants = await read_tenants(redis, keys, model, shards)
    queued: dict[str, int] = {}
    for stream in keys.streams(model, shards, tenants=tenants):
        length = await redis.xlen(stream)
        pending = 0
        if length or await redis.exists(stream):
            try:
                pending = int((await redis.xpending(stream, GROUP))["pending"])
            except Exception:
                pending = 0
        name = keys.parse_stream(stream)
        who = name.tenant or NO_TENANT  # waiting: in the stream, not yet taken by a worker
        queued[who] = queued.get(who, 0) + max(int(length) - pending, 0)
        if name.tenant:
            if not length and not pending:
                continue  # a tenant's empty streams: shown in the tenants table
            label = f"{name.priority}:{name.shard}:{name.tenant}"
        else:
            label = f"{name.priority}:{name.shard}"
        streams[label] = {"length": length, "pending": pending}
    stats: dict[str, int] = {}
    for shard in range(shards):
        raw_stats = await redis.hgetall(keys.stats(model, shard))  # type: ignore[misc]
        for k, v in raw_stats.items():
            stats[_s(k)] = stats.get(_s(k), 0) + int(v)
    asked = sum(stats.get(k, 0) for k in ("cache_hits", "queued", "joined"))
    worker_hits = sum(int(w.get("cache_hits", 0)) for w in workers)
    kv_reused = sum(int(w.get("kv", {}).get("tokens_reused", 0)) for w in workers)
    kv_requested = sum(int(w.get("kv", {}).get("tokens_requested", 0)) for w in workers)
    return {
        "workers": workers,
        "streams": streams,
        "requests_per_s": round(sum(float(w.get("requests_per_s", 0)) for w in workers), 2),
        "shared_cache_hit_rate": (stats.get("cache_hits", 0) + worker_hits) / asked
        if asked
        else None,
        "kv_hit_rate": kv_reused / kv_requested if kv_requested else None,
        "dead_letters": await redis.xlen(keys.dead(model)),
        "producer_counters": stats,
        "tenants": tenant_table(workers, stats, queued),
    }


def tenant_table(
    workers: list[dict[str, Any]], stats: dict[str, int], queued: dict[str, int]
) -> dict[str, dict[str, float]]:
    """Per tenant: the workers' counters summed (``worker.stream.consumer.TENANT_FIELDS``),
    the producers' cache hits (answered by SUBMIT, before any worker saw them) and requests
    queued now. Requests with no tenant are under ``-``."""
    out: dict[str, dict[str, float]] = {}
    for w in workers:
        for tenant, counters in (w.get("tenants") or {}).items():
            row = out.setdefault(tenant, {})
            for k, v in counters.items():
                row[k] = row.get(k, 0) + float(v)
    named_hits = 0
    for k, v in stats.items():
        if k.startswith("cache_hits:"):
            out.setdefault(k.split(":", 1)[1], {})["producer_cache_hits"] = v
            named_hits += v
    if stats.get("cache_hits", 0) - named_hits:
        out.setdefault("-", {})["producer_cache_hits"] = stats["cache_hits"] - named_hits
    for tenant, n in queued.items():
        out.setdefault(tenant, {})["queued"] = n
    return out


async def _jobs(redis: AnyRedis, keys: Keys) -> dict[str, dict[str, Any]]:
    jobs: dict[str, dict[str, Any]] = {}
    async for key in redis.scan_iter(match=keys.job_progress("*"), count=500):
        raw = await redis.hgetall(key)  # type: ignore[misc]
        jobs[keys.job_id_of(key)] = {_s(k): _s(v) for k, v in raw.items()}
    return jobs


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render(data: dict[str, Any], where: str = "this Redis") -> str:
    """``data`` (``collect``) for people; ``where``: the Redis (and key prefix) it came from."""
    lines = [_memory(data["redis"])] if data.get("redis") else []
    if not data["models"]:
        lines.append(f"no model has registered a worker on {where} (yet)")
    for model, m in data["models"].items():
        if not m["workers"]:
            lines += _unserved(model, m)
            continue
        q = _queues(m["streams"])
        lines.append(f"model {model}")
        lines.append(
            f"  {len(m['workers'])} live worker(s), {m['requests_per_s']} req/s (last minute); {q}"
        )
        lines.append(
            f"  shared-cache hit rate {_pct(m['shared_cache_hit_rate'])}, "
            f"KV hit rate {_pct(m['kv_hit_rate'])}, dead letters {m['dead_letters']}"
        )
        for tenant, t in sorted(m.get("tenants", {}).items()):
            hits = int(t.get("cache_hits", 0) + t.get("producer_cache_hits", 0))
            wait_ms = 1000 * t.get("wait_s", 0) / max(t.get("requests", 0), 1)
            lines.append(
                f"    tenant {tenant}: {int(t.get('requests', 0))} requests, "
                f"{int(t.get('computed', 0))} computed ({int(t.get('prompt_tokens', 0))} prompt "
                f"tokens), cache hits {hits}, mean wait in the stream {wait_ms:.1f} ms, "
                f"compute {t.get('compute_s', 0):.2f}s, "
                f"{int(t.get('queued', 0))} queued now"
            )
        for w in m["workers"]:
            age = data["time"] - float(w.get("heartbeat_at", 0))
            lines.append(
                f"    {w['id']}  {w.get('backend')} on {w.get('device')} ({w.get('dtype')}), "
                f"batch {w.get('max_batch')}, heartbeat {age:.1f}s ago, "
                f"{w.get('requests_per_s', 0)} req/s, {w.get('requests', 0)} requests, "
                f"{w.get('rows', 0)} rows computed, {w.get('errors', 0)} errors"
            )
    if data.get("quotas"):
        lines.append("quotas (python -m worker.quota):")
        lines += [f"  {line}" for line in render_quotas(data["quotas"]).splitlines()]
    for job_id, job in data["jobs"].items():
        lines.append(
            f"job {job_id}: {job.get('state', '?')} {job.get('done', 0)}/{job.get('total', '?')} "
            f"done, {job.get('failed', 0)} failed, {job.get('rate', '-')} lines/s"
            + (f": {job['error']}" if job.get("error") else "")
        )
    return "\n".join(lines)


def _memory(r: dict[str, Any]) -> str:
    mb = r["used_memory"] / (1 << 20)
    if not r["maxmemory"]:
        return f"Redis: {mb:.1f} MB used, no maxmemory cap"
    line = (
        f"Redis: {mb:.1f} of {r['maxmemory'] / (1 << 20):.1f} MB (maxmemory-policy "
        f"{r['maxmemory_policy']}), {r['evicted_keys']} keys evicted, "
        f"{r['refused_oom']} commands refused for want of memory"
    )
    if r["full"]:
        line += (
            "; FULL: it refuses writes (requests fail with RedisFull, workers' heartbeats are "
            "refused, so they may show as dead): raise maxmemory, or use maxmemory-policy "
            "volatile-lru so that cached results are evicted"
        )
    return line


def _unserved(model: str, m: dict[str, Any]) -> list[str]:
    """A model no live worker serves: one line, and the streams that still hold requests."""
    waiting = {p: s for p, s in m["streams"].items() if s["length"] or s["pending"]}
    if not waiting:
        return [f"model {model}: no live worker, nothing queued (--forget {model} unlists it)"]
    return [f"model {model}: no live worker; {_queues(waiting)}"]


def _queues(streams: dict[str, dict[str, int]]) -> str:
    """By priority (``high``: interactive, ``low``: offline), requests queued (no worker has
    read them) and taken (read, not answered yet: a stream's pending entries, which stay in it
    until answered), then each stream that holds any (``priority:shard[:tenant] queued+taken``)."""
    totals: dict[str, list[int]] = {}
    busy = []
    for label, s in streams.items():
        taken = s["pending"]
        queued = max(s["length"] - taken, 0)
        total = totals.setdefault(label.split(":", 1)[0], [0, 0])
        total[0] += queued
        total[1] += taken
        if queued or taken:
            busy.append(f"{label} {queued}+{taken}")
    text = ", ".join(f"{p}: {q} queued + {n} taken" for p, (q, n) in totals.items())
    return text + (f" (by stream: {', '.join(busy)})" if busy else "")


async def forget(redis: AnyRedis, keys: Keys, model: str) -> str:
    """Take ``model`` off the list (its registration: name, metadata, worker list), unless a
    live worker serves it; a worker started for it registers it again. Returns what was done;
    :class:`Refused` says why not."""
    if not await redis.sismember(keys.models, model):  # type: ignore[misc]
        raise Refused(f"no model {model!r} is listed on this Redis")
    alive = await registry.live_workers(redis, keys, model)
    if alive:
        raise Refused(
            f"model {model!r} has {len(alive)} live worker(s), {alive[0]}...: stop them first"
        )
    m = await _model(redis, keys, model)
    queued = sum(s["length"] for s in m["streams"].values())
    await redis.srem(keys.models, model)  # type: ignore[misc]
    await redis.delete(keys.meta(model), keys.workers(model))
    left = f"; its {queued} queued request(s) stay for a worker started for it" if queued else ""
    return f"model {model!r} unlisted{left}"


async def cluster_trouble(url: str) -> str | None:
    """On a Redis Cluster that cannot serve every slot now (``cluster_state`` not ok, or a
    master with slots flagged failing: a node down, a failover in progress), one line naming the
    masters that do not answer and their slots, as the node at ``url`` sees them; else None
    (or when that node does not say: an ACL user without ``CLUSTER``)."""
    node = probe(url)
    try:
        info = _s(await node.execute_command("CLUSTER", "INFO"))
        nodes = _s(await node.execute_command("CLUSTER", "NODES"))
    except (RedisError, OSError):
        return None
    finally:
        await node.aclose()
    state = "ok"
    for line in info.splitlines():
        if line.startswith("cluster_state:"):
            state = line.split(":", 1)[1].strip()
    down = []
    for line in nodes.splitlines():
        f = line.split()
        if len(f) < 8 or "master" not in f[2] or not ({"fail", "fail?"} & set(f[2].split(","))):
            continue
        slots = [x for x in f[8:] if not x.startswith("[")]
        if slots:
            down.append(f"{f[1].split('@')[0]} (slots {' '.join(slots)}, {f[2]})")
    if state == "ok" and not down:
        return None
    said = "; ".join(down) if down else "no master is flagged failing"
    return (
        f"the Redis Cluster at {masked_url(url)} cannot serve every slot "
        f"(cluster_state:{state}): masters not answering: {said}"
    )


async def _collect_or_trouble(
    redis: AnyRedis, keys: Keys, url: str
) -> tuple[dict[str, Any] | None, str | None]:
    """:func:`collect` on a cluster, or what :func:`cluster_trouble` says once it says
    something: a node down failed the reads of its slots only after redis-py's retries (11 s,
    "cannot reach the pool's Redis at URL: Error 111 connecting to" another node than the
    URL's) or all of them ("The cluster is down"), naming neither the node nor its slots."""
    task = asyncio.ensure_future(collect(redis, keys))
    try:
        while True:
            if (await asyncio.wait({task}, timeout=1.0))[0]:
                try:
                    return task.result(), None
                except (RedisError, OSError) as e:
                    trouble = await cluster_trouble(url)
                    if trouble is None:
                        raise
                    return None, f"{trouble} ({e})"
            trouble = await cluster_trouble(url)
            if trouble is not None:
                return None, trouble
    finally:
        task.cancel()


async def run(url: str, prefix: str, watch_s: float, as_json: bool) -> None:
    redis = connect_redis(url)
    keys = Keys(prefix)
    cluster = isinstance(redis, RedisCluster)
    try:
        while True:
            data: dict[str, Any] | None = None
            trouble: str | None = None
            if cluster:
                data, trouble = await _collect_or_trouble(redis, keys, url)
            else:
                data = await collect(redis, keys)
            if trouble is not None and not watch_s:
                raise Refused(trouble)
            where = f"{masked_url(url)} under key prefix {prefix!r}"
            if data is None:
                text = json.dumps({"error": trouble}) if as_json else f"lmpool-status: {trouble}"
            elif as_json:
                text = json.dumps(data, indent=2, default=str)
            else:
                text = render(data, where)
            if watch_s:
                sys.stdout.write("\x1b[2J\x1b[H")  # clear the terminal between refreshes
            print(text, flush=True)
            if not watch_s:
                return
            await asyncio.sleep(watch_s)
    finally:
        await redis.aclose()


async def _forget(url: str, prefix: str, model: str) -> str:
    redis = connect_redis(url)
    try:
        return await forget(redis, Keys(prefix), model)
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    try:
        settings = Settings.from_env()
    except SettingsError as e:
        print(f"lmpool-status: {e}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="lmpool-status", description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=settings.redis_url)
    parser.add_argument("--prefix", default=settings.key_prefix, help="key prefix (tenant)")
    parser.add_argument("--watch", type=float, default=0.0, metavar="S", help="refresh every S s")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--forget", metavar="MODEL", help="take a model no live worker serves off the list"
    )
    args = parser.parse_args(argv)
    if args.watch < 0:
        parser.error(f"--watch {args.watch:g}: seconds between refreshes, 0 (print once) or more")
    try:
        cast(Any, parse_url)(check_url(args.redis_url))  # redis-py's own parse (unannotated)
    except ValueError as e:  # not a Redis URL: a bad argument (or setting), in one line
        print(f"lmpool-status: --redis-url {masked_url(args.redis_url)}: {e}", file=sys.stderr)
        return 2
    try:
        with reaching(args.redis_url):
            if args.forget is not None:
                print(asyncio.run(_forget(args.redis_url, args.prefix, args.forget)))
                return 0
            asyncio.run(run(args.redis_url, args.prefix, args.watch, args.json))
    except Refused as e:
        print(f"lmpool-status: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # the reader went away (``| head``): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except PoolUnreachable as e:
        print(f"lmpool-status: {e}", file=sys.stderr)
        return 1
    except RedisError as e:  # it answered, not as the pool's Redis: a wrong database or port
        print(f"lmpool-status: Redis at {masked_url(args.redis_url)} refused: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
