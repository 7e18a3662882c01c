"""The Redis key layout: every key lmpool reads or writes is spelled here and nowhere else.

All keys start with the configured prefix (``LMPOOL_KEY_PREFIX``, default ``lmpool``), so one
ACL pattern (``~lmpool:*``) covers a tenant and a second prefix isolates a second tenant.

=========================  =======  ==========================================================
key                        type     holds
=========================  =======  ==========================================================
``P:models``               set      names of models that have had a worker
``P:meta:M``               hash     model metadata and serialized tokenizer, from workers
``P:workers:M``            zset     worker id -> last heartbeat (ms) for model ``M``
``P:worker:W``             hash     one worker's description and counters (expires)
``P:req:M:high:S``         stream   interactive requests for model ``M``, shard ``S``
``P:req:M:low``            stream   offline requests for model ``M``
``P:lease:M:S``            string   id of the worker that owns shard ``S`` (expires)
``P:dead:M``               stream   requests that could not be answered (dead letters)
``P:stats:M``              hash     producer-side counters: cache_hits, queued, joined, rejected
``P:res:M:D``              string   result for content digest ``D`` (the shared output cache)
``P:wait:M:D``             set      reply lists waiting for digest ``D``
``P:fly:M:D``              string   marks digest ``D`` as queued, so it is queued only once
``P:reply:C``              list     replies for producer connection ``C``
``P:arq``                  arq      arq's job queue (offline jobs)
``P:job:J``                hash     progress of offline job ``J`` (``score_file``; expires)
=========================  =======  ==========================================================
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

GROUP = "lmpool-workers"
"""Consumer group every worker of a model reads through."""
PRIORITIES = ("high", "low")


@dataclass(frozen=True)
class Keys:
    """Key builder for one prefix (one tenant)."""

    prefix: str = "lmpool"

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    @property
    def models(self) -> str:
        return self._k("models")

    @property
    def arq_queue(self) -> str:
        return self._k("arq")

    def meta(self, model: str) -> str:
        return self._k("meta", model)

    def workers(self, model: str) -> str:
        return self._k("workers", model)

    def worker(self, worker_id: str) -> str:
        return self._k("worker", worker_id)

    def stream(self, model: str, priority: str = "high", shard: int = 0) -> str:
        """Interactive requests are sharded (prefix affinity); offline ones share one stream."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, not {priority!r}")
        if priority == "low":
            return self._k("req", model, "low")
        return self._k("req", model, "high", str(shard))

    def streams(self, model: str, shards: int) -> list[str]:
        """Request streams of a model: the interactive shards, then the offline stream."""
        return [self.stream(model, "high", s) for s in range(shards)] + [self.stream(model, "low")]

    def lease(self, model: str, shard: int) -> str:
        return self._k("lease", model, str(shard))

    def stats(self, model: str) -> str:
        return self._k("stats", model)

    def dead(self, model: str) -> str:
        return self._k("dead", model)

    def result(self, model: str, digest: str) -> str:
        return self._k("res", model, digest)

    def results(self, model: str) -> str:
        """SCAN pattern of every cached result of ``model``."""
        return self._k("res", model, "*")

    def waiters(self, model: str, digest: str) -> str:
        return self._k("wait", model, digest)

    def inflight(self, model: str, digest: str) -> str:
        return self._k("fly", model, digest)

    def reply(self, client_id: str) -> str:
        return self._k("reply", client_id)

    def job_progress(self, job_id: str) -> str:
        """Hash of an offline job's progress: done, total, failed, rate, updated_at, state."""
        return self._k("job", job_id)


def request_digest(
    fingerprint: str, kind: str, token_ids: list[int], lora: str | None, params: bytes = b""
) -> str:
    """Content address of a request: equal inputs to the same model give the same digest.

    ``params`` is the canonical encoding of kind-specific parameters (sampling settings, the
    continuation of a score request); token ids are hashed as packed 32-bit integers.
    """
    h = hashlib.blake2b(digest_size=20)
    for part in (fingerprint, kind, lora or ""):
        h.update(part.encode())
        h.update(b"\x00")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(b"\x00")
    h.update(params)
    return h.hexdigest()
