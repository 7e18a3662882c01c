"""Reading the model's streams: own shards first, then stealable ones, offline work last.

Interactive requests are sharded; each shard is leased to one worker (``worker.leases``), which
reads it first so that prompts sharing a prefix meet its KV cache. An idle worker also takes
entries from shards whose owner is gone or lagging (stealing). Offline streams are read only
when no interactive entry waits, and while interactive requests are recent, in small portions:
an interactive request that arrives meanwhile waits for at most one short step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from redis.exceptions import ResponseError

from shared import protocol
from shared.aio import wait_event
from shared.keys import GROUP, Keys
from shared.redis_conn import TRANSIENT, AnyRedis
from shared.settings import Settings
from worker.backends.base import OFFLINE_SHARE_EVERY
from worker.leases import LeaseKeeper
from worker.stream.tenants import FairReads, Shares, fair_read, read_tenants

BLOCK_MS = 1000
"""Longest blocking read: also the longest a stop waits for the reader."""
INTERACTIVE_RECENT_S = 5.0
"""Offline work runs in small portions for this long after the last interactive request."""
INTERACTIVE_GRACE_S = 0.005
"""After an interactive step, offline work waits this long: a caller that sends its next
request as soon as it has an answer (an SMC loop) gets it in ahead of the offline queue."""
CLUSTER_BLOCK_MS = 20
"""On a cluster, the longest blocking read of one shard while others may receive entries."""
TENANTS_REFRESH_S = 0.1
"""How often the shards' tenant sets are read while the reader is busy."""
OFFLINE_LOOK_MS = 10
"""While interactive requests came recently, an idle worker waits on its interactive streams
alone this long, then looks at the offline ones again (up to Redis' 100 ms clock when idle)."""
TENANT_POLL_MS = 3
"""While the model is busy and a tenant is at its look-ahead cap, the others' streams are
read in blocking reads this long, so that their next request joins the next step."""
TENANTS_NEW_MS = 100
"""Longest blocking read: the streams of a new tenant are not among those it waits on, so the
first request of a tenant new to the pool waits this long at most (Redis times blocking reads
out on its 100 ms clock: up to about 200 ms)."""


class ModelState(Protocol):
    """What the reader needs to know of the model's side (``worker.stream.compute.Compute``)."""

    @property
    def busy(self) -> bool:
        """A step is running."""

    @property
    def ready(self) -> list[Any]:
        """Jobs read and waiting for the next step."""

    @property
    def gathering(self) -> float:
        """Seconds a partly filled batch still waits for company (0: it does not)."""


@dataclass(eq=False)
class Entry:
    """One stream entry as read."""

    stream: str
    entry_id: str
    raw: bytes | None
    """The encoded request (field ``m``), None when the entry has none."""
    digest: str | None
    """The digest field (``d``), readable even when ``raw`` is not."""
    shard: int
    offline: bool
    tenant: str = ""
    """Whose request it is (from the stream's name); empty: no tenant."""
    carried: int = 0  # deliveries of the entries this one replaced (protocol.CARRIED_FIELD)
    waited_s: float = 0.0  # in its stream before this worker took it (counted when answered)

    @property
    def added_ms(self) -> int:
        """When it was added, on the Redis server's clock (an entry id starts with it)."""
        return int(self.entry_id.split("-", 1)[0])


class Reader:
    def __init__(
        self,
        redis: AnyRedis,
        settings: Settings,
        consumer_name: str,
        leases: LeaseKeeper | None = None,
    ) -> None:
        self.redis = redis
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.model = settings.served_model_name
        self.name = consumer_name
        self.leases = leases
        """None: this reader owns every shard."""
        self.shares = Shares(settings.weights())
        self.fair = FairReads(redis, self.keys, consumer_name, self.shares)
        self.tenants: dict[int, list[str]] = {}
        """Shard -> the tenants with streams there, as last read (``refresh_tenants``)."""
        self._tenants_read = -1e9
        self.room = asyncio.Event()
        """Set when the consumer has room for entries again (or stops)."""
        self.now_ms: Callable[[], float] = lambda: time.time() * 1000
        """Now on the Redis server's clock (entry ids are on it); the consumer sets it."""
        self.cluster = False
        """The streams live on a Redis Cluster: read one slot at a time."""
        self._turn = 0
        self._last_interactive = -1e9
        self._offline_after = 0.0
        self._held_back = 0
        self._share_due = False  # offline work's turn: read it first, whatever else waits
        self._named: dict[tuple[Any, ...], tuple[list[str], list[str]]] = {}
        self._drained = False
        """A read of the own streams came back short and no step has ended since: reading them
        again before the next step ends would find only what arrived in between."""

    @property
    def streams(self) -> list[str]:
        """Every request stream of the model this reader knows: each shard's streams of no
        tenant and of the tenants seen there."""
        return self.keys.streams(self.model, self.settings.shards, tenants=self.tenants)

    async def ensure_groups(self) -> None:
        """Create the consumer group on each stream; idempotent."""
        await self.refresh_tenants(force=True, create=False)
        await self._create_groups(self.streams)

    async def _create_groups(self, streams: list[str]) -> None:
        for stream in streams:
            try:
                # id 0: entries added before the group existed are read too
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    async def refresh_tenants(self, force: bool = False, create: bool = True) -> None:
        """Read the shards' tenant sets (SUBMIT adds a tenant to its shard's set with its first
        request there), at most every ``TENANTS_REFRESH_S`` unless ``force``; the streams of a
        tenant new to this reader, on every shard, get their consumer group (``create``)."""
        now = time.monotonic()
        if not force and now - self._tenants_read < TENANTS_REFRESH_S:
            return
        self._tenants_read = now
        found = await read_tenants(self.redis, self.keys, self.model, self.settings.shards)
        # a tenant seen on one shard is read on every shard: its next request may go to any
        names = sorted({t for ts in found.values() for t in ts})
        tenants = dict.fromkeys(range(self.settings.shards), names) if names else {}
        new = [
            self.keys.stream(self.model, p, shard, t)
            for shard, names in tenants.items()
            for t in names
            if t not in self.tenants.get(shard, ())
            for p in ("high", "low")
        ]
        self.tenants = tenants
        if new and create:
            await self._create_groups(new)

    # -- the offline policy ---------------------------------------------------------------
    def step_ended(self) -> None:
        """Called after each compute step: what arrived during it is read before the next."""
        self._drained = False
        self.room.set()

    def note_step(self, interactive: bool, offline_only: bool) -> None:
        """Called after each compute step that ran works: holds offline work back briefly after
        interactive steps, except for its guaranteed share."""
        if interactive:
            self._last_interactive = time.monotonic()
        if offline_only:
            self._held_back = 0
        elif interactive and self._held_back < OFFLINE_SHARE_EVERY:
            self._held_back += 1
            self._offline_after = time.monotonic() + INTERACTIVE_GRACE_S
        elif interactive:
            self._offline_after, self._held_back, self._share_due = 0.0, 0, True

    def _offline_count(self, count: int, busy: bool, backlog: bool) -> int:
        """How much offline work to take now: none while other work waits (offline work is
        never read ahead of interactive work); while interactive requests came recently, none
        while the model is busy and small portions when it is idle."""
        now = time.monotonic()
        recent = now - self._last_interactive < INTERACTIVE_RECENT_S
        if not self._share_due and (backlog or (recent and busy) or now < self._offline_after):
            return 0
        return min(count, self.settings.offline_batch) if recent else count

    # -- reading --------------------------------------------------------------------------
    def _shard_streams(self, priority: str) -> tuple[list[str], list[str]]:
        """Streams of ``priority`` of the shards this worker owns, and of the others (named
        once per set of owned shards: this runs several times per request)."""
        shards = self.settings.shards
        owned = frozenset(range(shards) if self.leases is None else self.leases.owned)
        tenants = tuple((s, tuple(t)) for s, t in sorted(self.tenants.items()))
        known = self._named.get((priority, owned, tenants))
        if known is None:

            def of(shard: int) -> list[str]:
                names = ["", *self.tenants.get(shard, [])]
                return [self.keys.stream(self.model, priority, shard, t) for t in names]

            mine = [x for s in sorted(owned) for x in of(s)]
            others = [x for s in range(shards) if s not in owned for x in of(s)]
            if len(self._named) > 64:  # leases and tenants change rarely; never grow unbounded
                self._named.clear()
            known = self._named[(priority, owned, tenants)] = (mine, others)
        return known

    async def read(
        self, count: int, model: ModelState, caps: dict[str, int] | None = None
    ) -> list[Entry]:
        """Up to ``count`` new entries in this order: own shards, other shards whose owner is
        gone or lagging (stealing), offline work; blocks briefly when there is none. ``caps``
        (tenant -> entries it may still have in the worker's look-ahead) keeps one tenant's
        flood from taking the room of another's next request."""
        await self.refresh_tenants()
        mine, others = self._shard_streams("high")
        low_mine, low_others = self._shard_streams("low")
        low = low_mine + low_others
        offline = self._offline_count(count, model.busy, bool(model.ready))
        try:
            stealable = await self._stealable(others)
            # own shards first, without blocking; when the model is idle and nothing else may be
            # read, the blocking read below is that read
            passes: list[tuple[list[str], int]] = []
            if stealable or offline or model.busy or model.ready or self._tenanted(mine):
                # own shards found drained since the last step: what came meanwhile waits for
                # the step's end all the same (one round trip less per step)
                own = [] if self._drained else mine
                passes = [(own, count), (stealable, count), (low, offline)]
                if self._share_due:  # offline work's guaranteed share: a portion of it first
                    self._share_due, passes = False, [passes[2], *passes[:2]]
            for streams, n in passes:
                if streams and n:
                    if streams is mine:
                        reply = await self._fair_read(streams, n, caps)
                        self._note_read(reply, n)
                    else:
                        reply = await self._xreadgroup(streams, n)
                    if reply:
                        self._mark(reply)
                        return self.parse(reply)
            # Block on our own streams, no longer than a heartbeat (when leases may change);
            # with other shards around, wake up soon to look for work to take over.
            block_ms = min(BLOCK_MS, int(1000 * self.settings.heartbeat_s), TENANTS_NEW_MS)
            if others:
                block_ms = min(block_ms, int(2 * self.settings.steal_after_ms))
            grace_ms = (self._offline_after - time.monotonic()) * 1000
            if grace_ms > 0:  # hold offline work back: the next interactive request is near
                block_ms = min(block_ms, int(grace_ms) + 1)
            block_ms = max(block_ms, 1)
            self.room.clear()  # before looking: a change after the look wakes the wait below
            gather_s = model.gathering
            if gather_s > 0 and mine:
                # a partly filled batch waits for company (LMPOOL_MAX_WAIT_MS): read what
                # comes meanwhile (no longer than any blocking read: a stop waits for it)
                block_ms = min(block_ms, max(1, int(gather_s * 1000)))
                reply = await self._xreadgroup(mine, count, block_ms)
                self._mark(reply)
                return self.parse(reply)
            if model.ready or (model.busy and not offline):
                # the model is busy or has work waiting: look again as soon as that changes
                # (offline work may then be read), rather than block on interactive streams;
                # but a tenant with room in the look-ahead is read as soon as its request comes
                room = {x: caps.get(self._tenant_of(x), 0) for x in mine} if caps else {}
                open_ = [x for x, n in room.items() if n > 0]
                if open_:
                    n = max(1, min(room[x] for x in open_))
                    reply = await self._xreadgroup(open_, n, min(block_ms, TENANT_POLL_MS))
                    self._mark(reply)
                    return self.parse(reply)
                await wait_event(self.room, block_ms / 1000)
                return []
            streams, n = mine, count
            if offline >= count:
                streams = [*mine, *low]
            elif offline and mine:
                # interactive requests came recently, the offline streams were empty just now:
                # one COUNT (the offline share) for both would split an SMC step's particles
                # over two reads, so the wait is on the own streams, briefly (OFFLINE_LOOK_MS)
                block_ms = min(block_ms, OFFLINE_LOOK_MS)
            elif offline:
                streams, n = low, offline
            if not streams:
                await asyncio.sleep(block_ms / 1000)
                return []
            if self._tenanted(streams):  # what arrives first, a little of each
                n = max(1, n // len(streams))
            reply = await self._xreadgroup(streams, n, block_ms)
            self._mark(reply)
            self._note_read(reply, n)
            return self.parse(reply)
        except ResponseError as e:
            if not stream_gone(e):
                raise
            await self.ensure_groups()  # the stream was deleted under us (FLUSHALL, DEL)
            return []

    # -- fair shares between tenants --------------------------------------------------------
    def _tenant_of(self, stream: str) -> str:
        return self.keys.parse_stream(stream).tenant

    def _tenanted(self, streams: list[str]) -> bool:
        """Some of ``streams`` may be tenants': a blocking read of all of them would share
        their entries equally, not by weight, so a fair read comes first."""
        return bool(self.tenants) and len(streams) > 1

    async def _fair_read(
        self, streams: list[str], count: int, caps: dict[str, int] | None = None
    ) -> Any:
        """Up to ``count`` entries of ``streams`` (this worker's own, non-blocking), shared by
        weight between their tenants (``worker.stream.tenants.fair_read``), none for a tenant
        whose ``caps`` entry is not positive. With no tenant: one plain read."""
        if not self.tenants:
            return await self._xreadgroup(streams, count)
        return await fair_read(self.fair, streams, count, caps)

    async def _xreadgroup(self, streams: list[str], count: int, block_ms: int | None = None) -> Any:
        """XREADGROUP of ``streams``. A cluster refuses one read of several slots, so there each
        stream is read alone, and a blocking read waits on one of them at a time (in turn),
        for at most ``CLUSTER_BLOCK_MS``: entries of the others wait that long at most."""
        if not self.cluster or len(streams) == 1:
            return await self.redis.xreadgroup(
                GROUP, self.name, dict.fromkeys(streams, ">"), count=count, block=block_ms
            )
        out: list[Any] = []
        for stream in streams:
            got = await self.redis.xreadgroup(GROUP, self.name, {stream: ">"}, count=count)
            if got:
                out.extend(got)
                count -= sum(len(items) for _, items in got)
                if count <= 0:
                    return out
        if out or block_ms is None:
            return out
        self._turn = (self._turn + 1) % len(streams)
        return await self.redis.xreadgroup(
            GROUP,
            self.name,
            {streams[self._turn]: ">"},
            count=count,
            block=min(block_ms, CLUSTER_BLOCK_MS),
        )

    def _note_read(self, reply: Any, asked: int) -> None:
        """After a read of the own streams: short, they are drained for now."""
        self._drained = sum(len(items) for _, items in reply or []) < asked

    def _mark(self, reply: Any) -> bool:
        """Note when interactive entries were last read; True if ``reply`` holds some."""
        for stream, _ in reply or []:
            if not self.keys.parse_stream(stream).offline:
                self._last_interactive = time.monotonic()
                return True
        return False

    async def _stealable(self, streams: list[str]) -> list[str]:
        """Those of ``streams`` with undelivered entries that nobody owns, or whose oldest
        undelivered entry waited ``steal_after_ms``: their owner is dead or busy."""
        if not streams:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.exists(self.keys.lease(self.model, self.keys.parse_stream(stream).shard))
            pipe.xinfo_groups(stream)
        replies = await pipe.execute(raise_on_error=False)
        if any(isinstance(r, TRANSIENT) for r in replies):
            raise next(r for r in replies if isinstance(r, TRANSIENT))
        now_ms = self.now_ms()
        lagging: list[tuple[str, bytes, bool]] = []
        out: list[str] = []
        for i, stream in enumerate(streams):
            owned, groups = replies[2 * i], replies[2 * i + 1]
            if isinstance(owned, Exception) or isinstance(groups, Exception):
                continue  # a stream not created yet, say: nothing to take
            group = next((g for g in groups or [] if _s(g.get("name")) == GROUP), None)
            # nil lag: Redis cannot count it (an entry deleted after a pending one): look
            if group is None or group.get("lag") == 0:
                continue
            if group.get("lag") and not owned:
                out.append(stream)
            else:
                lagging.append((stream, group["last-delivered-id"], not owned))
        if lagging:  # the oldest undelivered entry of each: is there one, how long has it waited?
            pipe = self.redis.pipeline(transaction=False)
            for stream, last, _ in lagging:
                pipe.xrange(stream, min=b"(" + _b(last), max="+", count=1)
            firsts = await pipe.execute(raise_on_error=False)
            for (stream, _, free), first in zip(lagging, firsts, strict=True):
                if isinstance(first, Exception) or not first:
                    continue
                added_ms = int(_s(first[0][0]).split("-", 1)[0])
                if free or now_ms - added_ms >= self.settings.steal_after_ms:
                    out.append(stream)
        return out

    async def claim(self, stream: str, entry_ids: list[str]) -> list[Entry]:
        """Take entries over from whichever consumer holds them, if still idle long enough."""
        idle_ms = int(self.settings.claim_after_s * 1000)
        items = await self.redis.xclaim(
            stream, GROUP, self.name, min_idle_time=idle_ms, message_ids=list[Any](entry_ids)
        )
        return self.entries_of(stream, [(i, f) for i, f in items if i is not None])

    def parse(self, reply: Any) -> list[Entry]:
        """Entries from an XREADGROUP reply (deleted entries come back without fields)."""
        out: list[Entry] = []
        for stream, items in reply or []:
            out.extend(self.entries_of(_s(stream), items))
        return out

    def entries_of(self, stream: str, items: Any) -> list[Entry]:
        name = self.keys.parse_stream(stream)
        where = (name.shard, name.offline, name.tenant)
        out = []
        for entry_id, fields in items:
            fields = fields or {}
            digest = fields.get(protocol.DIGEST_FIELD)
            digest = _s(digest) if digest is not None else None
            raw = fields.get(protocol.MESSAGE_FIELD)
            carried = fields.get(protocol.CARRIED_FIELD, b"0")
            carried = int(carried) if carried.isdigit() else 0
            out.append(Entry(stream, _s(entry_id), raw, digest, *where, carried))
        return out


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _b(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def stream_gone(error: ResponseError) -> bool:
    """The error says a stream or its group vanished (FLUSHALL, DEL, a failover to a replica
    that never saw them): recreate them and go on."""
    text = str(error)
    return "NOGROUP" in text or "UNBLOCKED" in text
