"""Run-time LoRA adapters on a worker: loaded from the pool's registry on first use, unloaded
once removed from it (see ``producer.adapters`` for the producer's side).

A request names a run-time adapter ``NAME@HASH``. The first one for an adapter this worker has
not loaded makes it read the registry entry of ``NAME``; if it still names ``NAME@HASH``, the
files are downloaded (checked against their hashes and ``LMPOOL_MAX_LORA_MB``) into
``LMPOOL_CACHE_DIR/lora/`` and the backend loads them between two model steps. An adapter that
was removed or replaced is refused with ``UnknownAdapter``. At each heartbeat the worker unloads
the adapters that left the registry.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from shared.errors import UnknownAdapter
from shared.keys import Keys
from shared.redis_conn import AnyRedis
from shared.registry import adapter_name, file_hash, is_runtime_adapter, parse_adapter
from shared.settings import Settings
from worker.backends.base import Backend

log = logging.getLogger("lmpool.worker")
RunInCompute = Callable[[Callable[[], Any]], Awaitable[Any]]


class AdapterLoader:
    def __init__(
        self, redis: AnyRedis, backend: Backend, settings: Settings, run_in_compute: RunInCompute
    ) -> None:
        self.redis = redis
        self.backend = backend
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.model = settings.served_model_name
        self.run_in_compute = run_in_compute
        self.folder = Path(settings.cache_dir).expanduser() / "lora" / _safe(self.model)
        self._loading: dict[str, asyncio.Task[None]] = {}

    def loaded(self) -> set[str]:
        return {a for a in self.backend.info["adapters"] if is_runtime_adapter(a)}

    async def ensure(self, adapter_ids: set[str]) -> dict[str, UnknownAdapter]:
        """Load every adapter of ``adapter_ids`` not loaded yet; the ones that cannot be, with
        the reason."""
        failed: dict[str, UnknownAdapter] = {}
        for adapter_id in adapter_ids - self.loaded():
            task = self._loading.get(adapter_id)
            if task is None:
                task = self._loading[adapter_id] = asyncio.create_task(self._load(adapter_id))
            try:
                await asyncio.shield(task)
            except UnknownAdapter as e:
                failed[adapter_id] = e
            except Exception as e:
                log.warning("loading adapter %s failed", adapter_id, exc_info=True)
                failed[adapter_id] = UnknownAdapter(
                    f"LoRA adapter {adapter_name(adapter_id)!r} could not be loaded: {e}"
                )
            finally:
                if task.done():
                    self._loading.pop(adapter_id, None)
        return failed

    async def _load(self, adapter_id: str) -> None:
        name = adapter_name(adapter_id)
        raw = await self.redis.hget(self.keys.lora_registry(self.model), name)  # type: ignore[misc]
        if raw is None:
            raise UnknownAdapter(f"unknown LoRA adapter {name!r} (not registered, or removed)")
        entry = parse_adapter(raw)
        if entry["id"] != adapter_id:
            raise UnknownAdapter(
                f"LoRA adapter {name!r} was replaced since this request was made; send it again"
            )
        limit = self.settings.max_lora_mb << 20
        if entry["bytes"] > limit:
            raise UnknownAdapter(
                f"LoRA adapter {name!r} is {entry['bytes'] / 2**20:.1f} MiB; this worker's "
                f"LMPOOL_MAX_LORA_MB is {self.settings.max_lora_mb}"
            )
        files = list(entry["files"].items())
        pipe = self.redis.pipeline(transaction=False)
        for _, fhash in files:
            pipe.get(self.keys.lora_file(self.model, name, fhash))
        contents = await pipe.execute()
        folder = self.folder / adapter_id
        tmp = folder.with_name(folder.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for (fname, fhash), data in zip(files, contents, strict=True):
            if data is None or file_hash(data) != fhash or Path(fname).name != fname:
                shutil.rmtree(tmp, ignore_errors=True)
                raise UnknownAdapter(f"LoRA adapter {name!r}: file {fname} is missing or damaged")
            (tmp / fname).write_bytes(data)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        try:
            await self.run_in_compute(lambda: self.backend.add_lora(adapter_id, str(folder)))
        except Exception:
            shutil.rmtree(folder, ignore_errors=True)  # sync() removes only loaded ones
            raise
        log.info("loaded run-time LoRA adapter %s", adapter_id)

    async def sync(self) -> None:
        """Unload the run-time adapters no longer in the registry (or replaced there)."""
        loaded = self.loaded()
        if not loaded:
            return
        raw = await self.redis.hgetall(self.keys.lora_registry(self.model))  # type: ignore[misc]
        current = {parse_adapter(v)["id"] for v in raw.values()}
        for adapter_id in loaded - current:
            await self.run_in_compute(functools.partial(self.backend.remove_lora, adapter_id))
            shutil.rmtree(self.folder / adapter_id, ignore_errors=True)
            log.info("unloaded run-time LoRA adapter %s (removed from the registry)", adapter_id)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)
