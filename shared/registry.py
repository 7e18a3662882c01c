"""Model metadata and worker liveness in Redis: written by workers, read by producers and status.

A worker's entry in ``workers:M`` is scored with the time (ms) until which it counts as alive:
three heartbeat periods ahead. Readers need no knowledge of the workers' heartbeat setting.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypedDict

from shared.errors import ProtocolError
from shared.keys import Keys
from shared.protocol import PROTOCOL_VERSION
from shared.redis_conn import AnyRedis


class ModelDescription(TypedDict):
    """What a backend reports of its model (``Backend.info``): the model part of the
    metadata that :class:`ModelMeta` extends with what is pool-wide."""

    name_or_path: str
    """What the worker loaded (``LMPOOL_MODEL``, or the bundled default's file name)."""
    fingerprint: str
    """Identity of the weights and compute dtype: part of every request digest."""
    vocab_size: int
    max_length: int
    """The model's context length."""
    eos_token_ids: list[int]
    bos_token_id: int | None
    dtype: str
    device: str
    tokenizer_json: str
    """The fast tokenizer's own serialization (``tokenizer.json``)."""
    tokenizer_config: dict[str, Any]
    """Special tokens and the chat template beyond ``tokenizer_json``."""
    adapters: list[str]
    """LoRA adapters loaded at start-up (``LMPOOL_LORA``)."""


class ModelMeta(ModelDescription):
    """A model's metadata (``Keys.meta``), published by its workers, read by producers and
    the status command: everything a producer needs, so its host needs no model files."""

    backend: str
    max_queue: int
    """Pool-wide: the longest request stream (SUBMIT refuses more)."""
    shards: int
    """Pool-wide: interactive streams per model."""
    result_ttl_s: int
    """Pool-wide: a result's TTL, given at its first read (``GETEX``) or when it is due."""
    affinity_tokens: int
    """Pool-wide: leading tokens that pick a prompt's shard."""
    prompt_limit: int
    """Longest prompt the workers take: producers refuse longer ones before sending."""
    max_message_bytes: int
    """Largest request message the workers decode: producers refuse larger ones."""
    wire_dtype: str
    """The dtype results travel in (callers always get float32)."""
    protocol: int
    """The workers' wire protocol version."""


async def server_now_ms(redis: AnyRedis) -> int:
    """Now on the Redis server's clock (heartbeats, quota leases and entry ids are on it: a
    host whose own clock is off neither hides a live worker nor shows a dead one)."""
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def live_workers(
    redis: AnyRedis, keys: Keys, model: str, now_ms: float | None = None
) -> list[str]:
    """Ids of the workers of ``model`` whose heartbeat has not lapsed at ``now_ms`` (the Redis
    server's clock; read from it when not given)."""
    if now_ms is None:
        now_ms = await server_now_ms(redis)
    ids = await redis.zrangebyscore(keys.workers(model), int(now_ms), "+inf")
    return [i.decode() if isinstance(i, bytes) else i for i in ids]


async def read_meta(redis: AnyRedis, keys: Keys, model: str) -> ModelMeta | None:
    raw = await redis.hgetall(keys.meta(model))  # type: ignore[misc]
    return parse_meta(raw) if raw else None


def parse_meta(raw: dict[bytes, bytes]) -> ModelMeta:
    """The metadata hash as written by :func:`write_meta` (JSON values); ``ProtocolError``
    when it lacks a field (workers of another version) or speaks another protocol."""
    meta = {k.decode(): json.loads(v) for k, v in raw.items()}
    missing = set(ModelMeta.__annotations__) - set(meta)
    if missing:
        raise ProtocolError(
            f"the model's metadata lacks {sorted(missing)}: its workers run another lmpool version"
        )
    if meta["protocol"] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"the model's workers speak protocol {meta['protocol']}, this producer "
            f"{PROTOCOL_VERSION}: upgrade the older side"
        )
    return meta  # type: ignore[return-value]


async def write_meta(redis: AnyRedis, keys: Keys, model: str, meta: ModelMeta) -> None:
    fields = {k: json.dumps(v) for k, v in meta.items()}
    # not a transaction: the keys live in different cluster slots; a reader that comes between
    # the two finds no metadata and asks again
    pipe = redis.pipeline(transaction=False)
    pipe.delete(keys.meta(model))
    pipe.hset(keys.meta(model), mapping=fields)
    pipe.sadd(keys.models, model)
    await pipe.execute()


async def heartbeat(
    redis: AnyRedis,
    keys: Keys,
    model: str,
    worker_id: str,
    period_s: float,
    info: dict[str, Any],
    now_ms: float,
) -> None:
    """``now_ms``: on the Redis server's clock (``server_now_ms``, or a worker's clock plus its
    measured offset)."""
    alive_until = int(now_ms) + int(3 * period_s * 1000)
    fields = {k: json.dumps(v) for k, v in info.items()}
    pipe = redis.pipeline(transaction=False)
    pipe.zadd(keys.workers(model), {worker_id: alive_until})
    pipe.zremrangebyscore(keys.workers(model), "-inf", int(now_ms) - 3_600_000)
    pipe.hset(keys.worker(worker_id), mapping=fields)
    pipe.pexpire(keys.worker(worker_id), int(3 * period_s * 1000))
    await pipe.execute()


async def unregister(redis: AnyRedis, keys: Keys, model: str, worker_id: str) -> None:
    pipe = redis.pipeline(transaction=False)
    pipe.zrem(keys.workers(model), worker_id)
    pipe.delete(keys.worker(worker_id))
    await pipe.execute()


async def worker_info(redis: AnyRedis, keys: Keys, worker_id: str) -> dict[str, Any]:
    raw = await redis.hgetall(keys.worker(worker_id))  # type: ignore[misc]
    return {k.decode(): json.loads(v) for k, v in raw.items()}


# -- LoRA adapters added at run time ----------------------------------------------------------
class AdapterEntry(TypedDict):
    """A run-time adapter in the model's registry hash (``Keys.lora_registry``), by name."""

    id: str
    """``NAME@HASH``: the adapter as requests name it; ``HASH`` covers every file's content."""
    files: dict[str, str]
    """File name -> content hash; each file is stored under ``Keys.lora_file``."""
    bytes: int
    """Total size of the files."""


def file_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def adapter_entry(name: str, files: dict[str, bytes]) -> AdapterEntry:
    """The registry entry of adapter ``name`` made of ``files`` (name -> content)."""
    h = hashlib.blake2b(digest_size=8)
    listing = {}
    for fname in sorted(files):
        listing[fname] = file_hash(files[fname])
        h.update(fname.encode() + b"\0" + listing[fname].encode())
    return {
        "id": f"{name}@{h.hexdigest()}",
        "files": listing,
        "bytes": sum(map(len, files.values())),
    }


def parse_adapter(raw: bytes | str) -> AdapterEntry:
    entry = json.loads(raw)
    if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
        raise ValueError("malformed adapter registry entry")
    return entry  # type: ignore[return-value]


def is_runtime_adapter(adapter_id: str | None) -> bool:
    """Run-time adapters travel as ``NAME@HASH``; static ones (``LMPOOL_LORA``) by name."""
    return adapter_id is not None and "@" in adapter_id


def adapter_name(adapter_id: str) -> str:
    return adapter_id.split("@", 1)[0]
