"""``RemoteLM``: genlm-backend's ``AsyncLM`` interface, served by the pool.

Results come from three levels, cheapest first: this object's LRU (``clear_cache()`` empties
it), the shared Redis cache (content-addressed, so any producer's earlier request counts), and
finally the workers. Concurrent identical requests, from this producer or any other, cause one
forward row.

One object serves every event loop and thread that calls it (see ``producer.client``). Methods
that genlm-backend makes synchronous stay synchronous here; those that need the network
(``cache_kv``, ``clear_kv_cache``, ``add_new_lora``, ``remove_lora``) block the calling thread
when no event loop runs in it, and otherwise run as a task of the running loop (returned, so
``await lm.cache_kv(ids)`` waits for it) instead of blocking that loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from producer.adapters import AdapterMethods, AdapterNames
from producer.background import awaitable, run_or_thread
from producer.cache import OutputCache
from producer.calls import Calls
from producer.client import PoolClient, Prepared
from producer.connect import resolve_settings, wait_for_model, wait_for_model_sync
from producer.genlm import register_with_genlm
from producer.inputs import sample_params, token_array
from producer.routing import shard_of
from producer.tokenization.vocab import Vocabularies
from shared import protocol
from shared.errors import InvalidRequest
from shared.heap import keep_freed_memory
from shared.keys import request_digest
from shared.registry import ModelMeta
from shared.settings import Settings
from shared.tokenizer import tokenizer_from_json

log = logging.getLogger("lmpool.producer")
Ids = Sequence[int] | torch.Tensor | np.ndarray
T = TypeVar("T")
SET_LORA_REMOVED = (
    "set_lora() was removed: there is no active-adapter global anymore. "
    "Pass lora_name= per call (next_token_logprobs/sample/...)."
)
CLEAR_LORA_REMOVED = "clear_lora() was removed: omit lora_name (None = base model)."


class RemoteLM(AdapterMethods):
    """A language model in the pool, used like genlm-backend's ``AsyncLM``.

    Build it with ``await RemoteLM.connect(...)`` (or ``RemoteLM.from_name(...)`` without an
    event loop); ``tokenizer``, ``byte_vocab`` and ``str_vocab`` come from the workers, so this
    host needs no model files.
    """

    def __init__(
        self,
        client: PoolClient,
        meta: ModelMeta,
        timeout_s: float,
        cache_size: int = 0,
    ) -> None:
        self._client = client
        self.model = client.model
        self.meta = meta
        self.timeout_s = timeout_s
        self.fingerprint = meta["fingerprint"]
        self.vocab_size = meta["vocab_size"]
        self.eos_token_ids = list(meta["eos_token_ids"])
        self.prompt_limit = meta["prompt_limit"]
        """Longest prompt the workers take (their context, or LMPOOL_MAX_PROMPT_TOKENS)."""
        self.max_message_bytes = meta["max_message_bytes"]
        self.tokenizer = tokenizer_from_json(meta["tokenizer_json"], meta["tokenizer_config"])
        self._vocab = Vocabularies(self.tokenizer)  # built on first use, genlm's Token if found
        self.cache = OutputCache(cache_size)
        self._runner = Calls(client, self.cache)
        self.affinity: str | None = None
        """Default affinity key of this object's requests (e.g. an SMC run id)."""
        self._pinned: set[tuple[bytes, str | None, int]] = set()
        """(ids, adapter, shard) of each prefix pinned by ``cache_kv``, on each shard it was."""
        """Prefixes this object pinned with ``cache_kv`` (ids, adapter) -> shard."""
        self._adapters = AdapterNames()
        self._adapter_changes: dict[str, Future[Any]] = {}
        self._adapter_pool: ThreadPoolExecutor | None = None

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
        tenant: str | None = None,
        quota_wait: bool | None = None,
    ) -> RemoteLM:
        """Connect to the pool and wait for a live worker of ``model``.

        Arguments left as None come from ``LMPOOL_*`` variables (``LMPOOL_REDIS_URL``,
        ``LMPOOL_MODEL_NAME`` or ``LMPOOL_MODEL``, ``LMPOOL_TIMEOUT_S``,
        ``LMPOOL_CONNECT_TIMEOUT_S``, ``LMPOOL_TENANT``). ``timeout_s`` bounds each request;
        ``priority="low"`` sends requests to the offline streams that workers serve after
        interactive work. ``tenant`` names whose requests these are, where Redis ACLs are not
        used; with ACLs the tenant is the ACL user (``producer.connect.resolve_tenant``). Over
        the tenant's quota a call raises ``QuotaExceeded`` at once, or with ``quota_wait=True``
        (``LMPOOL_QUOTA_WAIT``) waits for room within ``timeout_s`` (``producer.quota``).
        """
        settings, name = resolve_settings(
            settings, redis_url, model, timeout_s, connect_timeout_s, tenant, quota_wait
        )
        meta, offset, tenant = await wait_for_model(settings, name)
        return cls._build(settings.replace(tenant=tenant), name, meta, offset, priority, cache_size)

    @classmethod
    def from_name(
        cls,
        model_name: str | None = None,
        redis_url: str | None = None,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> RemoteLM:
        """Blocking :meth:`connect` for code without an event loop (genlm's ``from_name``)."""
        settings, name = resolve_settings(
            kwargs.pop("settings", None),
            redis_url,
            model_name,
            timeout_s,
            kwargs.pop("connect_timeout_s", None),
            kwargs.pop("tenant", None),
            kwargs.pop("quota_wait", None),
        )
        meta, offset, tenant = wait_for_model_sync(settings, name)
        return cls._build(settings.replace(tenant=tenant), name, meta, offset, **kwargs)

    @classmethod
    def _build(
        cls,
        settings: Settings,
        name: str,
        meta: ModelMeta,
        clock_offset_ms: float,
        priority: str = "high",
        cache_size: int = 1024,
    ) -> RemoteLM:
        settings = settings.replace(  # pool-wide, set by the workers
            max_queue=meta["max_queue"],
            shards=meta["shards"],
            affinity_tokens=meta["affinity_tokens"],
            result_ttl_s=meta["result_ttl_s"],
        )
        if settings.keep_freed_memory:
            keep_freed_memory()  # rows arrive in fresh buffers every step (shared.heap)
        client = PoolClient(settings, name, priority, clock_offset_ms)
        return cls(client, meta, settings.timeout_s, cache_size)

    @property
    def tenant(self) -> str:
        """Whose requests these are (``RemoteLM.connect``'s ``tenant``, or the ACL user); empty:
        no tenant."""
        return self._client.settings.tenant

    # -- vocabularies -------------------------------------------------------------------------
    @property
    def byte_vocab(self) -> list[Any]:
        """``Token`` (bytes) of every token id, as genlm-backend decodes them: genlm-backend's
        own ``Token`` class when it is installed (genlm-control checks it), else ours."""
        return self._vocab.byte_vocab

    @property
    def str_vocab(self) -> list[str]:
        return self._vocab.str_vocab

    # -- requests -------------------------------------------------------------------------
    def _prepare(
        self,
        kind: str,
        token_ids: Ids,
        lora: str | None,
        params: dict[str, Any],
        affinity: str | None = None,
        extra_tokens: int = 0,
    ) -> Prepared:
        """Checked, encoded, addressed and routed: everything but the deadline."""
        ids = token_array(token_ids, self.vocab_size)
        read, what = protocol.tokens_read(kind, len(ids), params)
        if read > self.prompt_limit:
            raise InvalidRequest(
                f"{what} of {read} tokens exceeds the limit of "
                f"{self.prompt_limit} (the model's context, or LMPOOL_MAX_PROMPT_TOKENS)"
            )
        size = protocol.message_bytes(len(ids), params)
        if size > self.max_message_bytes:
            raise InvalidRequest(
                f"a request of {len(ids) + extra_tokens} tokens (~{size} bytes) exceeds "
                f"the workers' LMPOOL_MAX_MESSAGE_BYTES={self.max_message_bytes}"
            )
        if lora is not None and not isinstance(lora, str):
            raise InvalidRequest(f"lora_name must be a string or None, not {lora!r}")
        raw = ids.tobytes()
        digest = request_digest(
            self.fingerprint, kind, raw, lora, protocol.canonical_params(kind, params)
        )
        s = self._client.settings
        shard = shard_of(raw, s.shards, s.affinity_tokens, affinity or self.affinity)
        request: protocol.Request = {
            "v": protocol.PROTOCOL_VERSION,
            "kind": kind,
            "digest": digest,
            "ids": raw,
            "lora": lora,
            "params": params,
            "deadline_ms": 0,
        }
        return Prepared(digest, shard, request)

    async def _call(self, prepared: Prepared) -> torch.Tensor:
        return await self._runner.one(prepared, self.timeout_s)

    async def _calls(self, prepared: list[Prepared]) -> list[torch.Tensor]:
        return await self._runner.run(prepared, self.timeout_s)

    async def next_token_logprobs(
        self, token_ids: Ids, lora_name: str | None = None, *, affinity: str | None = None
    ) -> torch.Tensor:
        """Normalized log-probs of the next token, a float32 tensor of ``vocab_size``.

        ``affinity`` (default: this object's ``affinity``) routes requests with the same key to
        the same worker, whose KV cache then holds their common prefix; without one, the first
        ``affinity_tokens`` tokens decide.
        """
        lora = await self._adapter(lora_name) if lora_name is not None else None
        return await self._call(self._prepare("logprobs", token_ids, lora, {}, affinity))

    async def batch_next_token_logprobs(
        self,
        token_ids_list: Sequence[Ids],
        lora_name: str | None = None,
        *,
        affinity: str | None = None,
    ) -> torch.Tensor:
        """``[N, vocab_size]`` (``[0, vocab_size]`` for no prompts); the N requests go to Redis
        in one pipeline."""
        lora = await self._adapter(lora_name) if lora_name is not None else None
        prepared = [self._prepare("logprobs", ids, lora, {}, affinity) for ids in token_ids_list]
        return self._rows(await self._calls(prepared))

    def next_token_logprobs_sync(
        self, token_ids: Ids, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking form; safe with or without a running event loop in this thread."""
        return self.batch_next_token_logprobs_sync([token_ids], lora_name)[0]

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Ids], lora_name: str | None = None
    ) -> torch.Tensor:
        lora = self._adapter_sync(lora_name)
        prepared = [self._prepare("logprobs", ids, lora, {}) for ids in token_ids_list]
        return self._rows(self._call_sync(prepared))

    def _rows(self, rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(rows) if rows else torch.empty((0, self.vocab_size))

    def next_token_logprobs_uncached(
        self, token_ids: Ids, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking, without this object's LRU (genlm's uncached path; the shared cache still
        answers, with the same numbers the workers would compute)."""
        prepared = self._prepare("logprobs", token_ids, self._adapter_sync(lora_name), {})
        raw = self._runner.request_sync([prepared], self.timeout_s)
        return protocol.decode_result(raw[prepared.digest])

    def _call_sync(self, prepared: list[Prepared]) -> list[torch.Tensor]:
        return self._runner.run_sync(prepared, self.timeout_s)

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
        ``temperature=0`` takes the most likely token at each step (greedy decoding).
        """
        (tokens,) = await self.batch_sample(
            [prompt_token_ids], max_tokens, eos_token_ids, temperature, seed, lora_name
        )
        return tokens

    async def batch_sample(
        self,
        prompt_token_ids_list: Sequence[Ids],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[list[int]]:
        """:meth:`sample` for each prompt, as one call (one quota admission for all). As in
        genlm-backend (a gather of :meth:`sample` calls), one seed serves every prompt, and
        without one each prompt draws anew: the same prompt twice gives two draws."""
        lora = await self._adapter(lora_name) if lora_name is not None else None
        prepared = [
            self._prepare(
                "sample", ids, lora, sample_params(max_tokens, eos_token_ids, temperature, seed)
            )
            for ids in prompt_token_ids_list
        ]
        return [[int(t) for t in tokens.tolist()] for tokens in await self._calls(prepared)]

    async def score(
        self,
        prompt_ids: Ids,
        continuation_ids: Ids,
        lora_name: str | None = None,
        *,
        greedy: bool = False,
    ) -> torch.Tensor:
        """Log-prob of each continuation token given all before it (one forward pass), a
        float32 tensor ``[n]``; with ``greedy=True``, ``[n, 2]``: the log-prob and 1.0 where the
        token is the argmax of its position (ties to the lowest id, as ``torch.argmax``), so
        ``bool(out[:, 1].all())`` says whether the continuation is the greedy one."""
        cont = token_array(continuation_ids, self.vocab_size, "continuation").tolist()
        lora = await self._adapter(lora_name) if lora_name is not None else None
        params: dict[str, Any] = {"cont": cont}
        if greedy:  # absent otherwise: the plain form's requests keep their digests
            params["greedy"] = True
        # the model reads the prompt and the continuation but its last token
        prepared = self._prepare("score", prompt_ids, lora, params, extra_tokens=len(cont) - 1)
        return await self._call(prepared)

    # -- KV cache hints ---------------------------------------------------------------------
    def cache_kv(
        self, prompt_tokens: Ids, lora_name: str | None = None, *, affinity: str | None = None
    ) -> Any:
        """Compute this prefix's key/values on the worker that serves its shard and keep them
        from eviction there (genlm's ``cache_kv``; a plain method, as there).

        Without a running event loop it blocks and returns True if a worker pinned it (the hf
        backend's KV cache). Inside one it runs in a thread of the loop's default executor and
        returns its future (``await`` it for the answer; if nobody does, it still runs to its
        end, even past the loop's, and a failure is logged): it never blocks the loop.
        """
        ids = token_array(prompt_tokens, self.vocab_size)  # bad ids fail here, at once

        def prepare(lora: str | None) -> Prepared:
            prepared = self._prepare("cache_kv", ids, lora, {"pin": True}, affinity)
            self._pinned.add((prepared.request["ids"], lora, prepared.shard))
            return prepared

        # the base model's pin is filed at once: a clear_kv_cache() right after unpins it
        ready = prepare(None) if lora_name is None else None

        def pin_now() -> bool:
            prepared = ready or prepare(self._adapter_sync(lora_name))
            return bool(self._call_sync([prepared])[0].item())

        return run_or_thread(pin_now)

    def clear_kv_cache(self) -> Any:
        """Unpin every prefix this object pinned with ``cache_kv``: the workers may evict them
        again (genlm's ``clear_kv_cache``). Blocking without a loop; inside one, in a thread,
        as ``cache_kv``."""
        pins, self._pinned = sorted(self._pinned, key=lambda pin: pin[2]), set()
        rounds: list[list[Prepared]] = []
        """Calls of distinct digests each: one prefix pinned on two shards is unpinned twice."""
        for ids, lora, shard in pins:
            p = self._prepare("cache_kv", np.frombuffer(ids, "<i4"), lora, {"pin": False})
            p.shard = shard  # where it was pinned, whatever the affinity
            free = next((r for r in rounds if all(q.digest != p.digest for q in r)), None)
            if free is None:
                rounds.append(free := [])
            free.append(p)

        def unpin() -> None:
            for prepared in rounds:
                self._call_sync(prepared)

        return run_or_thread(unpin)

    def set_lora(self, lora_path: Any, lora_name: Any) -> None:
        """Removed in genlm-backend 0.3.1, as here: adapters are chosen per call."""
        raise RuntimeError(SET_LORA_REMOVED)

    def clear_lora(self) -> None:
        """Removed in genlm-backend 0.3.1, as here: ``lora_name=None`` is the base model."""
        raise RuntimeError(CLEAR_LORA_REMOVED)

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
        """Fail every request still waiting on this object, in every loop."""
        self._client.reset()

    async def release_all(self) -> None:
        """genlm's ``AsyncVirtualLM.release_all`` (end of an inference run): unpins this
        object's ``cache_kv`` prefixes."""
        await awaitable(self.clear_kv_cache())

    @property
    def underlying_model(self) -> Any:
        raise AttributeError(
            "a RemoteLM has no model in this process: the model runs on the pool's workers"
        )

    async def close(self) -> None:
        """Close every connection of this object, in every loop and thread."""
        await self._client.close()

    def cleanup(self) -> None:
        """Synchronous close (genlm's ``cleanup``); inside a running loop it is scheduled."""
        self._client.close_sync()

    async def __aenter__(self) -> RemoteLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __enter__(self) -> RemoteLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


register_with_genlm(RemoteLM)
__all__ = ["RemoteLM", "token_array"]
