"""One worker process's part of the pool: publish the model, heartbeat, consume, reclaim."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from typing import Any

from shared import heap, registry
from shared.aio import OutageLog, wait_event
from shared.errors import ProtocolError, SettingsError
from shared.keys import Keys
from shared.protocol import PROTOCOL_VERSION
from shared.redis_conn import TRANSIENT, AnyRedis, connect_redis, connect_redis_sync, masked_url
from shared.registry import ModelMeta
from shared.settings import Settings
from worker.backends.base import Backend, EngineDead
from worker.leases import LeaseKeeper
from worker.metrics import Metrics
from worker.stream.consumer import Consumer
from worker.stream.reclaim import leave_groups, reclaim_loop, renew_loop

log = logging.getLogger("lmpool.worker")
EXPIRED_LOG_S = 60.0
"""Requests dropped unrun (their askers gave up) are said at most once in this long."""


class PoolWorker:
    def __init__(self, settings: Settings, backend: Backend, cluster: bool = False) -> None:
        self.settings = settings
        self.backend = backend
        self.keys = Keys(settings.key_prefix)
        self.model = settings.served_model_name
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.cluster = cluster
        """``LMPOOL_REDIS_URL`` names a Redis Cluster (detected at start-up)."""
        self.redis: AnyRedis = connect_redis(settings.redis_url)
        self.consumer = Consumer(self.redis, backend, settings, self.worker_id, cluster)
        self.metrics = Metrics(self.model, backend.name)
        self.consumer.metrics = self.metrics
        self.leases = LeaseKeeper(
            self.redis,
            self.keys,
            self.model,
            self.worker_id,
            settings.shards,
            ttl_ms=int(3 * settings.heartbeat_s * 1000),
        )
        self.consumer.leases = self.leases
        self.started_at = time.time()
        self._stopping = asyncio.Event()
        self._expired_said = (0, float("-inf"))
        """Expired requests said so far, and when (``_say_expired``)."""
        self.trim = heap.Trimmer()
        self._busy_s_seen = -1.0
        """The batches' busy seconds at the last heartbeat: unchanged since, the worker idled."""
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        if self.settings.metrics_port:
            self.metrics.serve(self.settings.metrics_port)
        await self._sync_clock()
        await self._publish_meta()
        await self.consumer.ensure_groups()
        await self._beat()
        await self._rebalance()
        consumer = asyncio.create_task(self.consumer.run(), name="lmpool-consumer")
        consumer.add_done_callback(self._consumer_done)
        # Renewals go on while a stopping worker finishes what it holds (else its producers
        # queue those requests again, and other workers take them over, as from a dead one).
        served = asyncio.Event()
        consumer.add_done_callback(lambda _: served.set())
        self._tasks = [
            consumer,
            asyncio.create_task(self._heartbeat_loop(), name="lmpool-heartbeat"),
            asyncio.create_task(reclaim_loop(self.consumer, self._stopping), name="lmpool-reclaim"),
            asyncio.create_task(renew_loop(self.consumer, served), name="lmpool-renew"),
        ]
        url = masked_url(self.settings.redis_url)  # log lines never show the password
        log.info("worker %s serving %s on %s", self.worker_id, self.model, url)

    async def _publish_meta(self) -> None:
        """Publish model metadata; refuse to mix different weights under one model name."""
        s = self.settings
        meta: ModelMeta = {
            **self.backend.info,
            "backend": self.backend.name,
            # pool-wide: producers route and bound their requests with these
            "max_queue": s.max_queue,
            "shards": s.shards,
            "affinity_tokens": s.affinity_tokens,
            # what producers check before sending, so a bad request fails at the edge
            "prompt_limit": self.backend.prompt_limit(s.max_prompt_tokens),
            "max_message_bytes": s.max_message_bytes,
            "wire_dtype": s.wire_dtype,
            "result_ttl_s": s.result_ttl_s,
            "protocol": PROTOCOL_VERSION,
        }
        try:
            old = await registry.read_meta(self.redis, self.keys, self.model)
        except ProtocolError:
            old = None  # another version's: this worker's replaces it
        if old is not None and await registry.live_workers(self.redis, self.keys, self.model):
            for name in ("fingerprint", "shards", "affinity_tokens"):
                if old[name] != meta[name]:
                    raise SettingsError(
                        f"model name {self.model!r} is served by live workers with {name} "
                        f"{old[name]!r}, this worker has {meta[name]!r}: align the settings, "
                        "or set LMPOOL_MODEL_NAME to tell the two apart"
                    )
        await registry.write_meta(self.redis, self.keys, self.model, meta)

    async def _republish_if_lost(self) -> None:
        """After a FLUSHALL, a restart without persistence or a failover to a replica that
        never saw them, the model's metadata and streams are gone: create them again, so
        producers find this worker and its groups exist (the heartbeat re-registers it)."""
        if await self.redis.exists(self.keys.meta(self.model)):
            return
        log.warning("the model's metadata vanished from Redis: publishing it again")
        await self._publish_meta()
        await self.consumer.ensure_groups()

    def describe(self) -> dict[str, Any]:
        st = self.consumer.stats
        return {
            "model": self.model,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "backend": self.backend.name,
            "device": self.backend.info["device"],
            "dtype": self.backend.info["dtype"],
            "max_batch": self.settings.max_batch,
            "started_at": self.started_at,
            "heartbeat_at": time.time(),
            "requests": st.requests,
            "batches": st.batches,
            "computed": st.computed,
            "rows": self.backend.rows_computed,
            "tokens": self.backend.tokens_computed,
            "cache_hits": st.cache_hits,
            "skipped": st.skipped,
            "errors": st.errors,
            "dead_letters": st.dead_letters,
            "requests_per_s": round(st.per_second(), 2),
            "busy_s": round(st.busy_s, 3),
            "tenants": {t: {k: round(v, 4) for k, v in c.items()} for t, c in st.tenants.items()},
            "kv": self.kv_stats(),
            "adapters": list(self.backend.info["adapters"]),
            "shards": sorted(self.leases.owned),
            "gc": heap.FULL_COLLECTIONS.describe(),
            "freed_memory_kept": heap.freed_memory_kept(),
            "heap_trims": self.trim.trims,
        }

    async def _rebalance(self) -> None:
        live = await registry.live_workers(
            self.redis, self.keys, self.model, self.consumer.now_ms()
        )
        before = set(self.leases.owned)
        after = await self.leases.refresh(len(live))
        if after != before:
            await self._beat()  # the heartbeat shows the shards held now, not a period ago
            log.info(
                "shards owned: %s (of %d, %d live workers)",
                sorted(after),
                self.settings.shards,
                len(live),
            )

    def kv_stats(self) -> dict[str, int]:
        return dict(self.backend.kv_stats())

    async def _sync_clock(self) -> None:
        """The Redis server's clock minus ours: request deadlines and entry ages use it."""
        t0 = time.time()
        seconds, micros = await self.redis.time()
        self.consumer.clock_offset_ms = seconds * 1000 + micros / 1000 - (t0 + time.time()) * 500

    def _consumer_done(self, task: asyncio.Task[None]) -> None:
        """The consumer ends only when stopped, or when its engine died: then the process
        exits non-zero so that its supervisor restarts it; its entries stay pending and the
        other workers reclaim them."""
        if task.cancelled() or self._stopping.is_set():
            return
        error = task.exception()
        if error is None:
            return
        if isinstance(error, EngineDead):
            log.critical(
                "the engine died: %s; exiting so that a supervisor restarts this worker", error
            )
        else:
            log.critical("the consumer failed: %r; exiting", error, exc_info=error)
        exit_now(self, 3)

    async def _beat(self) -> None:
        kv = self.kv_stats()
        if kv:
            self.metrics.observe_kv(kv)
        await registry.heartbeat(
            self.redis,
            self.keys,
            self.model,
            self.worker_id,
            self.settings.heartbeat_s,
            self.describe(),
            self.consumer.now_ms(),
        )

    def _say_expired(self) -> None:
        """A warning, at most one a minute, when requests were dropped unrun since the last:
        their askers gave up (``LMPOOL_TIMEOUT_S``) before this worker reached them."""
        stats, now = self.consumer.stats, time.monotonic()
        dropped = stats.expired - self._expired_said[0]
        if dropped and now - self._expired_said[1] >= EXPIRED_LOG_S:
            log.warning(
                "%d request(s) dropped unrun in the last %.0f s: their deadlines passed while "
                "they were queued (the pool answers slower than the producers' timeouts: more "
                "workers, fewer requests in flight or a longer LMPOOL_TIMEOUT_S)",
                dropped,
                min(now - self._expired_said[1], now - stats.started),
            )
            self._expired_said = (stats.expired, now)

    async def _heartbeat_loop(self) -> None:
        outage = OutageLog(log, "for the heartbeat")
        while not self._stopping.is_set():
            await wait_event(self._stopping, self.settings.heartbeat_s)
            if self._stopping.is_set():
                return
            try:
                # First: it frees memory (no command it runs is refused at Redis' memory cap),
                # so that on a Redis full of unread results the writes below can run again.
                await self.consumer.writer.sweep(self.settings.shards)
                await self._sync_clock()
                await self._republish_if_lost()
                await self._beat()
                self._say_expired()
                await self._rebalance()
                await self.consumer.adapters.sync()
                # rows made in the compute thread and freed in this one (shared.heap)
                busy_s, self._busy_s_seen = self._busy_s_seen, self.consumer.stats.busy_s
                await asyncio.to_thread(self.trim, busy_s == self._busy_s_seen)
                outage.answered()
            except TRANSIENT as e:
                outage.failed(e)
            except Exception:
                log.exception("heartbeat failed; retrying")

    async def stop(self) -> None:
        """Stop reading, finish and acknowledge the batch in hand, unregister, close."""
        self._stopping.set()
        self.consumer.stop()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                log.error("worker task ended with %r", r)
        try:
            await self.leases.release_all()
        except Exception:
            log.warning("could not release shard leases; they expire by themselves")
        try:
            await leave_groups(self.consumer)
        except Exception:
            log.warning("could not leave the streams' groups; other workers take this one out")
        try:
            await registry.unregister(self.redis, self.keys, self.model, self.worker_id)
        except TRANSIENT as e:
            log.warning("could not unregister (%r); this worker's heartbeat expires by itself", e)
        await self.redis.aclose()
        self.metrics.close()
        self.backend.close()
        log.info("worker %s stopped", self.worker_id)


def exit_now(worker: PoolWorker, code: int) -> None:
    """Leave the process at once (the engine is gone: a graceful stop could hang on it),
    unregistering first when Redis answers quickly."""
    try:
        r = connect_redis_sync(worker.settings.redis_url, socket_timeout=2)
        pipe = r.pipeline(transaction=False)
        pipe.zrem(worker.keys.workers(worker.model), worker.worker_id)
        pipe.delete(worker.keys.worker(worker.worker_id))
        for shard in worker.leases.owned:
            pipe.delete(worker.keys.lease(worker.model, shard))
        pipe.execute()
        r.close()
    except Exception:
        log.warning("could not unregister before exiting", exc_info=True)
    logging.shutdown()
    os._exit(code)
