"""Model metadata and worker liveness in Redis: written by workers, read by producers and status.

A worker's entry in ``workers:M`` is scored with the time (ms) until which it counts as alive:
three heartbeat periods ahead. Readers need no knowledge of the workers' heartbeat setting.
"""

from __future__ import annotations

import json
import time
from typing import Any

from redis.asyncio import Redis

from shared.keys import Keys
from shared.protocol import PROTOCOL_VERSION

META_FIELDS = (
    "name_or_path",
    "fingerprint",
    "vocab_size",
    "max_length",
    "eos_token_ids",
    "bos_token_id",
    "dtype",
    "device",
    "tokenizer_json",
    "tokenizer_config",
    "adapters",
)


def now_ms() -> int:
    return int(time.time() * 1000)


async def live_workers(redis: Redis, keys: Keys, model: str) -> list[str]:
    """Ids of the workers of ``model`` whose heartbeat has not lapsed."""
    ids = await redis.zrangebyscore(keys.workers(model), now_ms(), "+inf")
    return [i.decode() if isinstance(i, bytes) else i for i in ids]


async def read_meta(redis: Redis, keys: Keys, model: str) -> dict[str, Any] | None:
    raw = await redis.hgetall(keys.meta(model))  # type: ignore[misc]
    if not raw:
        return None
    meta = {k.decode(): v.decode() for k, v in raw.items()}
    return {k: json.loads(v) for k, v in meta.items()}


async def write_meta(redis: Redis, keys: Keys, model: str, meta: dict[str, Any]) -> None:
    fields = {k: json.dumps(v) for k, v in meta.items()}
    fields["protocol"] = json.dumps(PROTOCOL_VERSION)
    pipe = redis.pipeline(transaction=True)
    pipe.delete(keys.meta(model))
    pipe.hset(keys.meta(model), mapping=fields)
    pipe.sadd(keys.models, model)
    await pipe.execute()


async def heartbeat(
    redis: Redis,
    keys: Keys,
    model: str,
    worker_id: str,
    period_s: float,
    info: dict[str, Any],
) -> None:
    alive_until = now_ms() + int(3 * period_s * 1000)
    fields = {k: json.dumps(v) for k, v in info.items()}
    pipe = redis.pipeline(transaction=False)
    pipe.zadd(keys.workers(model), {worker_id: alive_until})
    pipe.zremrangebyscore(keys.workers(model), "-inf", now_ms() - 3_600_000)
    pipe.hset(keys.worker(worker_id), mapping=fields)
    pipe.pexpire(keys.worker(worker_id), int(3 * period_s * 1000))
    await pipe.execute()


async def unregister(redis: Redis, keys: Keys, model: str, worker_id: str) -> None:
    pipe = redis.pipeline(transaction=False)
    pipe.zrem(keys.workers(model), worker_id)
    pipe.delete(keys.worker(worker_id))
    await pipe.execute()


async def worker_info(redis: Redis, keys: Keys, worker_id: str) -> dict[str, Any]:
    raw = await redis.hgetall(keys.worker(worker_id))  # type: ignore[misc]
    return {k.decode(): json.loads(v) for k, v in raw.items()}
