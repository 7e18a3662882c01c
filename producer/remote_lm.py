"""``RemoteLM``: genlm-backend's ``AsyncLM`` interface, served by the pool.

Results come from three levels, cheapest first: this object's LRU (``clear_cache()`` empties
it), the shared Redis cache (content-addressed, so any producer's earlier request counts), and
finally the workers. Concurrent identical requests, from this producer or any other, cause one
forward row.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import torch

from producer.client import PoolClient
from shared import protocol, registry
from shared.cache import OutputCache
from shared.errors import InvalidRequest, NoWorker
from shared.keys import request_digest
from shared.redis_conn import connect_redis
from shared.routing import shard_of
from shared.settings import Settings
from shared.tokenizer import tokenizer_from_json

Ids = Sequence[int] | torch.Tensor


class RemoteLM:
    """A language model in the pool, used like genlm-backend's ``AsyncLM``.

    Build it with ``await RemoteLM.connect(...)``; ``tokenizer``, ``byte_vocab`` and
    ``str_vocab`` come from the workers, so this host needs no model files.
    """

    def __init__(
        self,
        client: PoolClient,
        meta: dict[str, Any],
        timeout_s: float,
        cache_size: int = 0,
    ) -> None:
        self._client = client
        self.model = client.model
        self.meta = meta
        self.timeout_s = timeout_s
        self.fingerprint: str = meta["fingerprint"]
        self.vocab_size: int = int(meta["vocab_size"])
        self.eos_token_ids: list[int] = list(meta["eos_token_ids"])
        self.tokenizer = tokenizer_from_json(meta["tokenizer_json"], meta["tokenizer_config"])
        self._vocab: tuple[list[Any], list[str]] | None = None
        self._vocab_lock = threading.Lock()
        self.cache = OutputCache(cache_size)
        self.affinity: str | None = None
        """Default affinity key of this object's requests (e.g. an SMC run id)."""

    # -- construction -----------------------------------------------------------------------
    @classmethod
    async def connect(
        cls,
        redis_url: str | None = None,
        model: str | None = None,
        timeout_s: float | None = None,
        *,
        connect_timeout_s: float | None = None,
        cache_size: int = 1024,
        priority: str = "high",
        settings: Settings | None = None,
    ) -> RemoteLM:
        """Connect to the pool and wait for a live worker of ``model``.

        Arguments left as None come from ``LMPOOL_*`` variables (``LMPOOL_REDIS_URL``,
        ``LMPOOL_MODEL_NAME`` or ``LMPOOL_MODEL``, ``LMPOOL_TIMEOUT_S``,
        ``LMPOOL_CONNECT_TIMEOUT_S``). ``timeout_s`` bounds each request; ``priority="low"``
        sends requests to the offline stream that workers serve after interactive work.
        """
        settings = settings or Settings.from_env()
        settings = settings.replace(
            **{
                k: v
                for k, v in {
                    "redis_url": redis_url,
                    "timeout_s": timeout_s,
                    "connect_timeout_s": connect_timeout_s,
                }.items()
                if v is not None
            }
        )
        name = model or settings.served_model_name
        meta = await wait_for_model(settings, name)
        pool_wide = ("max_queue", "shards", "affinity_tokens")  # set by the workers
        settings = settings.replace(**{k: int(meta[k]) for k in pool_wide if k in meta})
        client = PoolClient(settings, name, priority)
        client.start()
        return cls(client, meta, settings.timeout_s, cache_size)

    # -- vocabularies -------------------------------------------------------------------------
    def _vocabs(self) -> tuple[list[Any], list[str]]:
        with self._vocab_lock:
            if self._vocab is None:
                from shared.vocab import decode_vocab

                byte_vocab, str_vocab = decode_vocab(self.tokenizer)
                self._vocab = (as_genlm_tokens(byte_vocab), str_vocab)
            return self._vocab

    @property
    def byte_vocab(self) -> list[Any]:
        """``Token`` (bytes) of every token id, as genlm-backend decodes them."""
        return self._vocabs()[0]

    @property
    def str_vocab(self) -> list[str]:
        return self._vocabs()[1]

    # -- requests -------------------------------------------------------------------------
    def _ids(self, token_ids: Ids) -> list[int]:
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        if not ids:
            raise InvalidRequest("empty prompt: at least one token id is needed")
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise InvalidRequest(f"token id {i!r} is not an integer in [0, {self.vocab_size})")
        return [int(i) for i in ids]

    def _message(
        self, kind: str, ids: list[int], lora: str | None, params: dict[str, Any]
    ) -> tuple[str, bytes]:
        digest = request_digest(
            self.fingerprint, kind, ids, lora, protocol.canonical_params(kind, params)
        )
        message = protocol.encode_request(
            {
                "v": protocol.PROTOCOL_VERSION,
                "kind": kind,
                "digest": digest,
                "ids": ids,
                "lora": lora,
                "params": params,
                "deadline_ms": registry.now_ms() + int(self.timeout_s * 1000),
                "client": self._client.client_id,
            }
        )
        return digest, message

    def _shard(self, ids: list[int], affinity: str | None) -> int:
        s = self._client.settings
        return shard_of(ids, s.shards, s.affinity_tokens, affinity or self.affinity)

    async def _call(
        self,
        kind: str,
        token_ids: Ids,
        lora: str | None,
        params: dict[str, Any],
        affinity: str | None = None,
    ) -> torch.Tensor:
        ids = self._ids(token_ids)
        digest, message = self._message(kind, ids, lora, params)
        cacheable = kind != "cache_kv"
        cached = self.cache.get(digest) if cacheable else None
        if cached is not None:
            return cached
        raw = await self._client.request(
            digest, message, self.timeout_s, self._shard(ids, affinity)
        )
        result = protocol.decode_result(raw)
        if cacheable:
            self.cache[digest] = result
        return result

    async def next_token_logprobs(
        self, token_ids: Ids, lora_name: str | None = None, *, affinity: str | None = None
    ) -> torch.Tensor:
        """Normalized log-probs of the next token, a 1-D tensor of ``vocab_size``.

        ``affinity`` (default: this object's ``affinity``) routes requests with the same key to
        the same worker, whose KV cache then holds their common prefix; without one, the first
        ``affinity_tokens`` tokens decide.
        """
        return await self._call("logprobs", token_ids, lora_name, {}, affinity)

    async def batch_next_token_logprobs(
        self,
        token_ids_list: Sequence[Ids],
        lora_name: str | None = None,
        *,
        affinity: str | None = None,
    ) -> torch.Tensor:
        """``[N, vocab_size]``; the N requests go to Redis in one pipeline."""
        rows = await asyncio.gather(
            *(self.next_token_logprobs(ids, lora_name, affinity=affinity) for ids in token_ids_list)
        )
        return torch.stack(rows)

    async def cache_kv(
        self, prompt_token_ids: Ids, lora_name: str | None = None, *, affinity: str | None = None
    ) -> bool:
        """Hint: compute this prefix's key/values on the worker that serves its shard and keep
        them from eviction there. True if a worker pinned it (the hf backend's KV cache)."""
        out = await self._call("cache_kv", prompt_token_ids, lora_name, {}, affinity)
        return bool(out.item())

    def next_token_logprobs_sync(
        self, token_ids: Ids, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking form; safe with or without a running event loop in this thread."""
        return self.batch_next_token_logprobs_sync([token_ids], lora_name)[0]

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Ids], lora_name: str | None = None
    ) -> torch.Tensor:
        return torch.stack(self._sync_call("logprobs", token_ids_list, lora_name, {}))

    def _sync_call(
        self, kind: str, token_ids_list: Sequence[Ids], lora: str | None, params: dict[str, Any]
    ) -> list[torch.Tensor]:
        all_ids = [self._ids(ids) for ids in token_ids_list]
        messages = [self._message(kind, ids, lora, params) for ids in all_ids]
        out: dict[str, torch.Tensor] = {}
        missing: dict[str, tuple[str, bytes, int]] = {}
        for ids, (digest, message) in zip(all_ids, messages, strict=True):
            hit = self.cache.get(digest)
            if hit is not None:
                out[digest] = hit
            else:
                missing[digest] = (digest, message, self._shard(ids, None))
        if missing:
            raw = self._client.sync().request_many(list(missing.values()), self.timeout_s)
            for digest, data in raw.items():
                out[digest] = self.cache[digest] = protocol.decode_result(data)
        return [out[d] for d, _ in messages]

    async def sample(
        self,
        prompt_token_ids: Ids,
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """A whole generation, run on one worker as one request; EOS is not appended.

        With a seed the result is reproducible (and cached); without one every call draws anew.
        """
        params = {
            "max_tokens": int(max_tokens),
            "eos": [int(t) for t in eos_token_ids],
            "temperature": float(temperature),
            "seed": seed if seed is not None else _fresh_seed(),
        }
        tokens = await self._call("sample", prompt_token_ids, lora_name, params)
        return [int(t) for t in tokens.tolist()]

    async def batch_sample(
        self,
        prompt_token_ids_list: Sequence[Ids],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[list[int]]:
        return list(
            await asyncio.gather(
                *(
                    self.sample(p, max_tokens, eos_token_ids, temperature, seed, lora_name)
                    for p in prompt_token_ids_list
                )
            )
        )

    async def score(
        self, prompt_ids: Ids, continuation_ids: Ids, lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-prob of each continuation token given all before it (one forward pass)."""
        cont = self._ids(continuation_ids)
        return await self._call("score", prompt_ids, lora_name, {"cont": cont})

    # -- caches and lifecycle -------------------------------------------------------------------
    def clear_cache(self) -> None:
        """Empty this producer's local cache (the shared Redis cache is kept)."""
        self.cache.clear()

    async def clear_shared_cache(self) -> int:
        """Delete every result of this model from the shared Redis cache (all producers lose
        them); returns how many were deleted. The local cache is cleared too."""
        self.cache.clear()
        return await self._client.clear_results()

    def reset_async_queries(self) -> None:
        """Fail every request still waiting on this object."""
        self._client.reset()

    async def close(self) -> None:
        await self._client.close()

    async def cleanup(self) -> None:
        await self.close()

    async def __aenter__(self) -> RemoteLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def wait_for_model(settings: Settings, model: str) -> dict[str, Any]:
    """Metadata of ``model`` once a live worker serves it; ``NoWorker`` after the timeout."""
    from shared.keys import Keys

    keys = Keys(settings.key_prefix)
    redis = connect_redis(settings.redis_url)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.connect_timeout_s
        while True:
            if await registry.live_workers(redis, keys, model):
                meta = await registry.read_meta(redis, keys, model)
                if meta is not None:
                    return meta
            if loop.time() >= deadline:
                seen = await redis.smembers(keys.models)  # type: ignore[misc]
                known = sorted(m.decode() for m in seen)
                raise NoWorker(
                    f"no live worker serves model {model!r} on {_safe_url(settings.redis_url)} "
                    f"after {settings.connect_timeout_s:g}s; models seen: {known or 'none'}. "
                    f"Start one: LMPOOL_MODEL=... arq worker.WorkerSettings"
                )
            await asyncio.sleep(0.1)
    finally:
        await redis.aclose()


def as_genlm_tokens(byte_vocab: list[Any]) -> list[Any]:
    """genlm-backend's own ``Token`` objects when it is installed, else ours.

    genlm-control tests ``isinstance(t, genlm.backend.tokenization.Token)``; the two classes
    behave the same, so a program sees identical vocabularies either way.
    """
    try:
        from genlm.backend.tokenization import Token as GenlmToken
    except Exception:  # not installed, or its optional imports fail: ours will do
        return byte_vocab
    return [GenlmToken(t.token_id, bytes(t)) for t in byte_vocab]


def _safe_url(url: str) -> str:
    """The URL without its password, for messages."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


def _fresh_seed() -> int:
    import secrets

    return secrets.randbits(62)
