"""One worker process's part of the pool: publish the model, heartbeat, consume, reclaim."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
import uuid
from typing import Any

from redis.asyncio import Redis

from shared import registry
from shared.errors import SettingsError
from shared.keys import Keys
from shared.redis_conn import connect_redis
from shared.settings import Settings
from worker.backends.base import Backend
from worker.consumer import Consumer
from worker.leases import LeaseKeeper
from worker.metrics import Metrics
from worker.reclaim import reclaim_loop

log = logging.getLogger("lmpool.worker")


class PoolWorker:
    def __init__(self, settings: Settings, backend: Backend) -> None:
        self.settings = settings
        self.backend = backend
        self.keys = Keys(settings.key_prefix)
        self.model = settings.served_model_name
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.redis: Redis = connect_redis(settings.redis_url)
        self.consumer = Consumer(self.redis, backend, settings, self.worker_id)
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
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        if self.settings.metrics_port:
            self.metrics.serve(self.settings.metrics_port)
        await self._publish_meta()
        await self.consumer.ensure_groups()
        await self._beat()
        await self._rebalance()
        self._tasks = [
            asyncio.create_task(self.consumer.run(), name="lmpool-consumer"),
            asyncio.create_task(self._heartbeat_loop(), name="lmpool-heartbeat"),
            asyncio.create_task(reclaim_loop(self.consumer, self._stopping), name="lmpool-reclaim"),
        ]
        log.info("worker %s serving %s on %s", self.worker_id, self.model, self.settings.redis_url)

    async def _publish_meta(self) -> None:
        """Publish model metadata; refuse to mix different weights under one model name."""
        meta = dataclasses.asdict(self.backend.info)
        old = await registry.read_meta(self.redis, self.keys, self.model)
        meta["backend"] = self.backend.name
        for name in ("max_queue", "shards", "affinity_tokens"):  # pool-wide: producers use them
            meta[name] = getattr(self.settings, name)
        if old is not None and await registry.live_workers(self.redis, self.keys, self.model):
            for name in ("fingerprint", "shards", "affinity_tokens"):
                if name in old and old[name] != meta[name]:
                    raise SettingsError(
                        f"model name {self.model!r} is served by live workers with {name} "
                        f"{old[name]!r}, this worker has {meta[name]!r}: align the settings, "
                        "or set LMPOOL_MODEL_NAME to tell the two apart"
                    )
        await registry.write_meta(self.redis, self.keys, self.model, meta)

    def describe(self) -> dict[str, Any]:
        st = self.consumer.stats
        return {
            "model": self.model,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "backend": self.backend.name,
            "device": self.backend.info.device,
            "dtype": self.backend.info.dtype,
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
            "kv": self.kv_stats(),
            "shards": sorted(self.leases.owned),
        }

    async def _rebalance(self) -> None:
        live = await registry.live_workers(self.redis, self.keys, self.model)
        before = set(self.leases.owned)
        after = await self.leases.refresh(len(live))
        if after != before:
            log.info(
                "shards owned: %s (of %d, %d live workers)",
                sorted(after),
                self.settings.shards,
                len(live),
            )

    def kv_stats(self) -> dict[str, int]:
        stats = getattr(self.backend, "kv_stats", None)
        return dict(stats()) if callable(stats) else {}

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
        )

    async def _heartbeat_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), timeout=self.settings.heartbeat_s)
            except asyncio.TimeoutError:
                pass
            if self._stopping.is_set():
                return
            try:
                await self._beat()
                await self._rebalance()
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
        await registry.unregister(self.redis, self.keys, self.model, self.worker_id)
        await self.redis.aclose()
        self.metrics.close()
        self.backend.close()
        log.info("worker %s stopped", self.worker_id)
