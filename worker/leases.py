"""Shard leases: each interactive shard of a model is owned by one live worker at a time.

Every heartbeat a worker renews its leases (``PEXPIRE`` if still its own) and moves towards an
even share, ``ceil(shards / live workers)``: it releases extras so a worker that joined can take
them, and takes free shards while it holds fewer. A dead worker's leases lapse after three
heartbeats and the survivors take them at their next one. Ownership only steers reading; any
worker may still answer any message (reclaim and stealing), so a lease race costs cache
locality, never correctness.
"""

from __future__ import annotations

import math
import random
from typing import Any

from shared.keys import Keys
from shared.redis_conn import AnyRedis
from shared.scripts import Script, execute

RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
RENEW_SCRIPT, RELEASE_SCRIPT = Script(RENEW), Script(RELEASE)


class LeaseKeeper:
    def __init__(
        self, redis: AnyRedis, keys: Keys, model: str, worker_id: str, shards: int, ttl_ms: int
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.model = model
        self.worker_id = worker_id
        self.shards = shards
        self.ttl_ms = ttl_ms
        self.owned: set[int] = set()

    async def _run(self, script: Script, shard: int, *args: Any) -> Any:
        key = self.keys.lease(self.model, shard)
        (out,) = await execute(
            self.redis, lambda pipe: script.queue(pipe, [key], [self.worker_id, *args]), [script]
        )
        return out

    async def refresh(self, live_workers: int) -> set[int]:
        """Renew, then release or acquire towards an even share; returns the owned shards."""
        for shard in sorted(self.owned):
            if not await self._run(RENEW_SCRIPT, shard, self.ttl_ms):
                self.owned.discard(shard)  # lapsed (we were too slow): someone else may own it
        target = math.ceil(self.shards / max(live_workers, 1))
        while len(self.owned) > target:
            shard = max(self.owned)
            await self._run(RELEASE_SCRIPT, shard)
            self.owned.discard(shard)
        if len(self.owned) < target:
            free = [s for s in range(self.shards) if s not in self.owned]
            random.shuffle(free)
            for shard in free:
                key = self.keys.lease(self.model, shard)
                if await self.redis.set(key, self.worker_id, nx=True, px=self.ttl_ms):
                    self.owned.add(shard)
                    if len(self.owned) >= target:
                        break
        return set(self.owned)

    async def owners(self) -> dict[int, str | None]:
        """Current owner of every shard (None: free)."""
        pipe = self.redis.pipeline(transaction=False)  # not MGET: the keys span cluster slots
        for s in range(self.shards):
            pipe.get(self.keys.lease(self.model, s))
        values = await pipe.execute()
        return {s: (v.decode() if v else None) for s, v in enumerate(values)}

    async def release_all(self) -> None:
        for shard in sorted(self.owned):
            await self._run(RELEASE_SCRIPT, shard)
        self.owned.clear()
