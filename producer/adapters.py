"""LoRA adapters added at run time, for the whole pool (genlm's ``add_new_lora``).

A producer uploads an adapter's files (PEFT: ``adapter_config.json`` and safetensors weights;
never pickled ``.bin`` files) to Redis once, in the model's adapter registry; every worker that
meets a request for it downloads and loads it on first use, and unloads it once it is removed.
On the wire a run-time adapter is named ``NAME@HASH`` (``HASH``: its content), so results cached
under one adapter never answer for another registered later under the same name; a producer
resolves a name to that id through the registry and keeps the answer for a moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from shared.errors import InvalidRequest, UnknownAdapter
from shared.keys import Keys, check_name
from shared.registry import AdapterEntry, adapter_entry, file_hash, parse_adapter

if TYPE_CHECKING:
    from producer.client import PoolClient

T = TypeVar("T")
log = logging.getLogger("lmpool.producer")

CONFIG_FILE = "adapter_config.json"
RESOLVE_TTL_S = 2.0
"""How long a producer trusts its name -> id map before asking the registry again."""


def adapter_files(path: str | Path, max_bytes: int) -> dict[str, bytes]:
    """The files of the PEFT adapter in ``path`` to upload: its config and safetensors."""
    folder = Path(path).expanduser()
    if not (folder / CONFIG_FILE).is_file():
        raise InvalidRequest(f"{folder} is not a PEFT adapter folder: no {CONFIG_FILE}")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"cannot read {folder / CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict) or "r" not in config:
        raise InvalidRequest(f"{folder / CONFIG_FILE} has no LoRA rank r")
    weights = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors")
    if not weights:
        pickled = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = f" ({', '.join(pickled)}: pickled, which lmpool never loads)" if pickled else ""
        raise InvalidRequest(f"{folder} holds no .safetensors weights{hint}")
    files = [folder / CONFIG_FILE, *weights]
    size = sum(p.stat().st_size for p in files)
    if size > max_bytes:
        raise InvalidRequest(
            f"adapter {folder} is {size / 2**20:.1f} MiB; LMPOOL_MAX_LORA_MB allows "
            f"{max_bytes / 2**20:g} MiB"
        )
    return {p.name: p.read_bytes() for p in files}


def upload_commands(
    keys: Keys, model: str, name: str, files: dict[str, bytes]
) -> tuple[str, list[tuple[str, tuple[Any, ...]]]]:
    """The adapter's id and the commands that register it, as ``(method, args)`` for a
    pipeline: the files first, the registry entry last, so no worker sees half an upload."""
    check_name("LoRA adapter name", name)
    if "@" in name:
        raise InvalidRequest(f"LoRA adapter name {name!r} must not contain '@'")
    entry = adapter_entry(name, files)
    commands: list[tuple[str, tuple[Any, ...]]] = [
        ("set", (keys.lora_file(model, name, entry["files"][fname]), data))
        for fname, data in files.items()
    ]
    commands.append(("hset", (keys.lora_registry(model), name, json.dumps(entry))))
    return entry["id"], commands


def removal_commands(
    keys: Keys, model: str, name: str, entry: AdapterEntry
) -> list[tuple[str, tuple[Any, ...]]]:
    file_keys = tuple(keys.lora_file(model, name, h) for h in entry["files"].values())
    out: list[tuple[str, tuple[Any, ...]]] = [("hdel", (keys.lora_registry(model), name))]
    if file_keys:
        out.append(("delete", file_keys))
    return out


class AdapterNames:
    """A producer's map from adapter names to their wire ids (``NAME@HASH`` for run-time
    adapters; the name itself for the workers' static ``LMPOOL_LORA`` ones)."""

    def __init__(self) -> None:
        self._ids: dict[str, tuple[str, float]] = {}

    def get(self, name: str) -> str | None:
        hit = self._ids.get(name)
        if hit is None or time.monotonic() - hit[1] > RESOLVE_TTL_S:
            return None
        return hit[0]

    def put(self, name: str, adapter_id: str) -> None:
        self._ids[name] = (adapter_id, time.monotonic())

    def forget(self, name: str) -> None:
        self._ids.pop(name, None)

    def learn(self, name: str, raw: bytes | None) -> str:
        """Remember and return the id of ``name`` given its registry entry (None: none)."""
        adapter_id = name if raw is None else parse_adapter(raw)["id"]
        self.put(name, adapter_id)
        return adapter_id


class AdapterMethods:
    """``RemoteLM``'s LoRA methods (genlm's ``add_new_lora`` / ``remove_lora``): adapters
    registered for the whole pool, and the name -> id resolution requests use."""

    _client: PoolClient
    model: str
    _adapters: AdapterNames
    _adapter_changes: dict[str, Future[Any]]
    """Adapter changes made inside a loop, by name (``_adapter_change``)."""
    _adapter_pool: ThreadPoolExecutor | None

    def add_new_lora(self, lora_path: str | Path, lora_name: str = "lora_1") -> Any:
        """Register a PEFT adapter for the whole pool under ``lora_name`` (genlm's
        ``add_new_lora``): its files are uploaded to Redis once, and every worker loads it on
        first use. Registering a name again replaces that adapter (its cached results stay
        apart: they are addressed by the adapter's content). Blocking without a running loop;
        inside one, a future (``_adapter_change``: requests naming the adapter wait for it)."""
        max_bytes = self._client.settings.max_lora_mb << 20
        files = adapter_files(lora_path, max_bytes)
        keys = self._client.keys
        adapter_id, commands = upload_commands(keys, self.model, lora_name, files)
        hashes = {file_hash(data) for data in files.values()}

        def upload_now() -> str:
            registry = keys.lora_registry(self.model)
            (raw,) = self._client.execute_sync([("hget", (registry, lora_name))])
            self._client.execute_sync(commands)
            # the files of the adapter it replaces, but the ones they share
            old = parse_adapter(raw)["files"].values() if raw is not None else ()
            stale = tuple(keys.lora_file(self.model, lora_name, h) for h in old if h not in hashes)
            if stale:
                self._client.execute_sync([("delete", stale)])
            self._adapters.put(lora_name, adapter_id)
            return adapter_id

        return self._adapter_change(lora_name, upload_now)

    def remove_lora(self, lora_name: str) -> Any:
        """Unregister a run-time adapter for the whole pool; workers unload it. Requests that
        name it afterwards fail with ``UnknownAdapter`` (a ``ValueError``)."""
        keys = self._client.keys
        registry = keys.lora_registry(self.model)

        def commands_for(raw: bytes | None) -> list[tuple[str, tuple[Any, ...]]]:
            self._adapters.forget(lora_name)
            if raw is None:
                raise UnknownAdapter(f"no run-time LoRA adapter {lora_name!r} to remove")
            return removal_commands(keys, self.model, lora_name, parse_adapter(raw))

        def remove_now() -> None:
            (raw,) = self._client.execute_sync([("hget", (registry, lora_name))])
            self._client.execute_sync(commands_for(raw))

        return self._adapter_change(lora_name, remove_now)

    def _adapter_change(self, name: str, change: Callable[[], T]) -> Any:
        """Run an adapter change: at once without a running loop; inside one, in this
        object's adapter thread (one change after the other), its future returned, which later
        requests for ``name`` wait for, blocking ones too (``_adapter_sync``: the change does
        not need the loop they block), so that a request never overtakes the upload it
        depends on."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return change()
        future = self._adapter_thread().submit(change)
        self._adapter_changes[name] = future
        wrapped = asyncio.wrap_future(future, loop=loop)

        def done(f: asyncio.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is not None:
                log.warning("changing LoRA adapter %r failed: %r", name, f.exception())

        wrapped.add_done_callback(done)
        return wrapped

    def _adapter_thread(self) -> ThreadPoolExecutor:
        if self._adapter_pool is None:
            self._adapter_pool = ThreadPoolExecutor(1, thread_name_prefix="lmpool-adapters")
        return self._adapter_pool

    async def _adapter(self, name: str) -> str:
        """The wire id of adapter ``name`` (waiting for a change of it in progress)."""
        change = self._adapter_changes.get(name)
        if change is not None:
            await asyncio.gather(asyncio.wrap_future(change), return_exceptions=True)
            if self._adapter_changes.get(name) is change:
                del self._adapter_changes[name]
        known = self._adapters.get(name)
        if known is not None:
            return known
        registry = self._client.keys.lora_registry(self.model)
        (raw,) = await self._client.execute([("hget", (registry, name))])
        return self._adapters.learn(name, raw)

    def _adapter_sync(self, name: str | None) -> str | None:
        if name is None:
            return None
        change = self._adapter_changes.get(name)
        if change is not None:
            with contextlib.suppress(Exception):  # its failure is its caller's to see
                change.result()
        known = self._adapters.get(name)
        if known is not None:
            return known
        registry = self._client.keys.lora_registry(self.model)
        (raw,) = self._client.execute_sync([("hget", (registry, name))])
        return self._adapters.learn(name, raw)
