"""One ``RemoteLM`` call's way to its results: this object's LRU first, then the tenant's quota
(``producer.quota``: the call's remaining requests admitted together, or none of them), then the
pool, every request of the call in flight at once."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import torch

from producer.cache import OutputCache
from producer.client import PoolClient, Prepared
from shared import protocol


class Calls:
    """Runs a ``RemoteLM``'s calls, from an event loop or blocking."""

    def __init__(self, client: PoolClient, cache: OutputCache) -> None:
        self.client = client
        self.cache = cache

    async def one(self, prepared: Prepared, timeout_s: float) -> torch.Tensor:
        """:meth:`run` for a call of one request (most calls: each particle's own)."""
        cacheable = _cacheable(prepared)
        hit = self.cache.get(prepared.digest) if cacheable else None
        if hit is not None:
            return hit
        if not self.client.quota.skips():
            return (await self.run([prepared], timeout_s))[0]
        result = protocol.decode_result(await self.client.request(prepared, timeout_s))
        if cacheable:
            self.cache[prepared.digest] = result
        return result

    async def run(self, prepared: list[Prepared], timeout_s: float) -> list[torch.Tensor]:
        """One result per request of ``prepared`` (duplicates asked once)."""
        out, missing = self._cached(prepared)
        if not missing:
            return [out[p.digest] for p in prepared]
        asking = list(missing.values())
        leases = [] if self.client.quota.skips() else await self.client.admit(asking, timeout_s)
        try:
            if len(asking) == 1:  # the usual call: no task of its own
                raws = [await self.client.request(asking[0], timeout_s)]
            else:
                raws = await asyncio.gather(*(self.client.request(p, timeout_s) for p in asking))
        finally:
            self.client.release(leases)
        self._store(missing, dict(zip(missing, raws, strict=True)), out)
        return [out[p.digest] for p in prepared]

    def run_sync(self, prepared: list[Prepared], timeout_s: float) -> list[torch.Tensor]:
        """:meth:`run`, blocking this thread."""
        out, missing = self._cached(prepared)
        if missing:
            self._store(missing, self.request_sync(list(missing.values()), timeout_s), out)
        return [out[p.digest] for p in prepared]

    def request_sync(self, prepared: list[Prepared], timeout_s: float) -> dict[str, bytes]:
        """Encoded results by digest, past the LRU (genlm's uncached path), quota kept."""
        skip = self.client.quota.skips()
        leases = [] if skip else self.client.admit_sync(prepared, timeout_s)
        try:
            return self.client.request_sync(prepared, timeout_s)
        finally:
            self.client.release_sync(leases)

    def _cached(
        self, prepared: list[Prepared]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Prepared]]:
        """``(found, missing)`` by digest: what the LRU holds, and the rest (once each)."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, Prepared] = {}
        for p in prepared:
            hit = self.cache.get(p.digest) if _cacheable(p) else None
            if hit is not None:
                found[p.digest] = hit
            else:
                missing[p.digest] = p
        return found, missing

    def _store(
        self,
        missing: dict[str, Prepared],
        raws: Mapping[str, bytes | bytearray],
        out: dict[str, torch.Tensor],
    ) -> None:
        for digest, data in raws.items():
            out[digest] = protocol.decode_result(data)
            if _cacheable(missing[digest]):
                self.cache[digest] = out[digest]


def _cacheable(p: Prepared) -> bool:
    """Whether ``p``'s result may go into the LRU: a ``cache_kv`` pin's never does."""
    return p.request["kind"] != "cache_kv"
