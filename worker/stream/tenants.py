"""Tenants on the worker's side: which have streams where, and fair shares of its reads.

:func:`read_tenants` reads the shards' tenant sets (SUBMIT adds a tenant to its shard's set
with its first request there). Fair shares are deficit round robin by weight.

Each read of the worker's own streams asks :meth:`Shares.quotas` how many entries each tenant
with streams there may have; the reader reads that many of each (one round trip), then
:meth:`Shares.settle` charges each tenant for what it got. A tenant's credit grows by its share
of every read (``LMPOOL_TENANT_WEIGHTS``; others weigh 1) and is kept while it has work
waiting, so over many reads the tenants that always have work get rows in proportion to their
weights; a tenant with nothing waiting loses its credit, and what it left is read for the
others in the same call (no row idles while any tenant has work).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.keys import GROUP, Keys
from shared.redis_conn import AnyRedis


async def read_tenants(
    redis: AnyRedis, keys: Keys, model: str, shards: int
) -> dict[int, list[str]]:
    """Shard -> the tenants with streams there (shards with none left out)."""
    pipe = redis.pipeline(transaction=False)
    for shard in range(shards):
        pipe.smembers(keys.tenants(model, shard))
    answers = await pipe.execute()
    out: dict[int, list[str]] = {}
    for shard, members in enumerate(answers):
        names = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members or ())
        if names:
            out[shard] = names
    return out


async def read_counts(redis: AnyRedis, consumer: str, reads: list[tuple[str, int]]) -> list[Any]:
    """Non-blocking XREADGROUPs of each ``(stream, count)`` in one pipeline (on a cluster,
    redis-py sends each node its part); the replies joined."""
    pipe = redis.pipeline(transaction=False)
    for stream, n in reads:
        pipe.xreadgroup(GROUP, consumer, {stream: ">"}, count=n)
    answers = await pipe.execute()
    return [item for answer in answers for item in answer or []]


class Shares:
    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights
        """Tenant -> weight (others, and requests with no tenant, weigh 1)."""
        self.deficit: dict[str, float] = {}
        """Tenant -> rows it is owed."""

    def quotas(self, tenants: list[str], count: int) -> dict[str, int]:
        """Rows each of ``tenants`` may have of the next ``count``."""
        weight = {t: self.weights.get(t, 1.0) for t in tenants}
        total = sum(weight.values())
        for _ in range(64):
            # a round of credit; more while nobody is owed a row (all still pay for reads that
            # brought more than their quota), as if the rounds between had been read
            for t in tenants:
                credit = self.deficit.get(t, 0.0) + count * weight[t] / total
                self.deficit[t] = min(credit, 2 * count + 1)
            if max(self.deficit[t] for t in tenants) >= 1:
                break
        quotas = {t: max(int(self.deficit[t]), 0) for t in tenants}
        excess = sum(quotas.values()) - count  # credit carried over may exceed one read
        for t in sorted(tenants, key=lambda t: self.deficit[t] / weight[t]):
            if excess <= 0:
                break
            take = min(excess, quotas[t])
            quotas[t] -= take
            excess -= take
        return quotas

    def settle(self, quotas: dict[str, int], got: dict[str, int], more: set[str]) -> None:
        """Charge each tenant read for the rows it got; one with nothing ``more`` waiting
        (its streams gave less than asked) loses its credit."""
        for t, q in quotas.items():
            if not q:
                continue  # not read this time: its credit stands
            self.deficit[t] = self.deficit.get(t, 0.0) - got.get(t, 0) if t in more else 0.0


@dataclass
class FairReads:
    """What :func:`fair_read` reads with."""

    redis: AnyRedis
    keys: Keys
    consumer: str
    shares: Shares


async def fair_read(
    fr: FairReads, streams: list[str], count: int, caps: dict[str, int] | None = None
) -> list[Any]:
    """Up to ``count`` entries of ``streams`` (non-blocking), shared between the tenants whose
    streams they are in proportion to their weights; what a tenant leaves unused goes to the
    others (no row is left idle while any tenant has work). ``caps``: tenant -> most entries it
    may have now (its room in the worker's look-ahead); a tenant missing from it has no cap."""
    groups: dict[str, list[str]] = {}
    for stream in streams:
        tenant = fr.keys.parse_stream(stream).tenant
        if caps is None or caps.get(tenant, count) > 0:
            groups.setdefault(tenant, []).append(stream)
    reply: list[Any] = []
    left = count
    for _ in range(3):  # the shares, then what they left to those with more waiting
        if not groups:
            break
        quotas = fr.shares.quotas(list(groups), left)
        if caps is not None:
            quotas = {t: min(q, caps.get(t, q)) for t, q in quotas.items()}
        # a tenant's quota spread over its streams (XREADGROUP's COUNT is per stream)
        per = {t: -(-q // len(groups[t])) for t, q in quotas.items() if q > 0}
        reads = [(x, n) for t, n in per.items() for x in groups[t]]
        answer = await read_counts(fr.redis, fr.consumer, reads)
        got: dict[str, int] = {}
        more: dict[str, list[str]] = {}  # streams that gave all they were asked for
        for stream, items in answer:
            name = stream.decode() if isinstance(stream, bytes) else str(stream)
            tenant = fr.keys.parse_stream(name).tenant
            got[tenant] = got.get(tenant, 0) + len(items)
            if len(items) >= per[tenant]:
                more.setdefault(tenant, []).append(name)
        reply += answer
        left -= sum(got.values())
        fr.shares.settle(quotas, got, set(more))
        if caps is not None:
            caps = {t: c - got.get(t, 0) for t, c in caps.items()}
            more = {t: x for t, x in more.items() if caps.get(t, 1) > 0}
        if left <= 0 or not more:
            break
        groups = more
    return reply
