"""The Redis key layout: every key lmpool reads or writes is spelled here, and parsed here.

All keys start with the configured prefix (``LMPOOL_KEY_PREFIX``, default ``lmpool``), so one
ACL pattern (``~lmpool:*``) covers a tenant's keys and a second prefix separates a second
tenant's. arq's own job keys (``arq:job:*``, ``arq:result:*``...) are named by arq and ignore the
prefix: the workers of every tenant share them (``shared.acl`` grants ``~arq:*``), producers
never touch them.

A model's requests are split into ``LMPOOL_SHARDS`` shards (by prompt prefix or affinity key,
see ``producer.routing``). Everything one request touches atomically, its shard's streams and
stats and its digest's result and waiters, carries the shard's hash tag
``{M:S}``: on a Redis Cluster they share one slot, so the SUBMIT and FINISH scripts stay
single-slot, and the shards of a model spread over the masters. A digest's keys live in the
slot of the shard its prompt is routed to, which is a function of the prompt (or of an explicit
affinity key): the same prompt asked with different affinity keys is cached once per shard.

The keys, one row each, are :data:`KEY_TABLE`; ``python -m shared.keys`` prints them as the
markdown table in ``docs/architecture.md`` (a test checks the two agree, and that every key
:class:`Keys` builds matches a row).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

KEY_TABLE: tuple[tuple[str, str, str], ...] = (
    ("P:models", "set", "names of models that have had a worker"),
    ("P:meta:M", "hash", "model metadata and serialized tokenizer, from workers"),
    ("P:workers:M", "zset", "worker id -> alive-until time (ms) for model `M`"),
    ("P:worker:W", "hash", "one worker's description and counters (expires)"),
    ("P:lease:M:S", "string", "id of the worker that owns shard `S` (expires)"),
    ("P:dead:M", "stream", "requests that could not be answered (dead letters)"),
    ("P:{M:S}:high", "stream", "interactive requests of shard `S` (producers with no tenant)"),
    ("P:{M:S}:low", "stream", "offline requests of shard `S` (producers with no tenant)"),
    ("P:{M:S}:high:T", "stream", "interactive requests of shard `S` from tenant `T`"),
    ("P:{M:S}:low:T", "stream", "offline requests of shard `S` from tenant `T`"),
    ("P:{M:S}:tenants", "set", "tenants that have streams on shard `S`"),
    ("P:{M:S}:stats", "hash", "producer-side counters: cache_hits, queued, joined, rejected"),
    ("P:{M:S}:res:D", "string", "result for content digest `D` (the shared output cache)"),
    ("P:{M:S}:due", "zset", "unread results (`r:D`), waiter sets (`w:D`) -> when due (ms)"),
    ("P:{M:S}:wait:D", "set", "reply lists waiting for digest `D`; while it exists, `D` is queued"),
    ("P:reply:C", "list", "replies for producer connection `C`"),
    ("P:quotas", "set", "tenants that have a quota"),
    ("P:quota:{T}", "hash", "tenant `T`'s quota: in_flight, tokens_per_s (0: no limit)"),
    ("P:quota:{T}:use", "hash", "its admitted and refused requests (counts)"),
    ("P:quota:{T}:bucket", "zset", "its token bucket: members `tokens`, `ms` (when last filled)"),
    ("P:quota:{T}:leases", "zset", "its requests in flight: lease id -> expiry time (ms)"),
    ("P:lora:M", "hash", "adapters added at run time: name -> description (JSON)"),
    ("P:lorafile:M:N:H", "string", "one file of adapter `N` (content hash `H`)"),
    ("P:arq", "arq", "arq's job queue (offline jobs)"),
    ("P:job:J", "hash", "progress of offline job `J` (`score_file`; expires)"),
)
"""Every key: its pattern (``P`` the prefix, ``M`` a model, ``S`` a shard, ``D`` a digest, ``C``
a producer connection, ``T`` a tenant, ``W`` a worker, ``N`` an adapter, ``H`` a content hash,
``J`` a job), its Redis type and what it holds."""


def key_table() -> str:
    """:data:`KEY_TABLE` as a markdown table."""
    lines = ["| key | type | holds |", "| --- | --- | --- |"]
    lines += [f"| `{key}` | {kind} | {holds} |" for key, kind, holds in KEY_TABLE]
    return "\n".join(lines) + "\n"


GROUP = "lmpool-workers"
"""Consumer group every worker of a model reads through."""
PRIORITIES = ("high", "low")
_TENANT = r"[A-Za-z0-9_.-]{1,64}"
_STREAM = re.compile(
    rf"\{{(?P<model>.*):(?P<shard>\d+)\}}:(?P<priority>high|low)(?::(?P<tenant>{_TENANT}))?$"
)


def check_tenant(name: str) -> str:
    """``name`` if it can name a tenant (1-64 letters, digits, ``_ . -``; it ends stream keys and
    ACL key patterns), else ``ValueError`` saying so. Empty means no tenant."""
    if name and not re.fullmatch(_TENANT, name):
        raise ValueError(
            f"tenant {name!r}: use 1-64 letters, digits, '_', '.' or '-' (it becomes part of "
            "Redis keys and ACL key patterns)"
        )
    return name


def check_name(kind: str, name: str) -> str:
    """``name`` if it can be part of a key: no braces (they would move the hash tag)."""
    if not name or "{" in name or "}" in name:
        raise ValueError(f"{kind} {name!r} must be non-empty and contain no braces")
    return name


@dataclass(frozen=True)
class StreamName:
    """What a request stream's name says: model, shard, priority."""

    model: str
    shard: int
    priority: str
    tenant: str = ""
    """Empty: the stream of producers with no tenant."""

    @property
    def offline(self) -> bool:
        return self.priority == "low"


@dataclass(frozen=True)
class Keys:
    """Key builder for one prefix (one tenant)."""

    prefix: str = "lmpool"

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def _tagged(self, model: str, shard: int, *parts: str) -> str:
        return ":".join((self.prefix, f"{{{model}:{shard}}}", *parts))

    # -- the pool --------------------------------------------------------------------------
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

    def everything_pattern(self) -> str:
        """SCAN pattern of every key of this prefix (clearing one pool off a shared server)."""
        return self._k("*")

    def worker_pattern(self) -> str:
        """SCAN pattern of every worker's description hash."""
        return self._k("worker", "*")

    def worker_id_of(self, key: str | bytes) -> str:
        """The worker id in a :meth:`worker` key."""
        text = key.decode() if isinstance(key, bytes) else key
        return text[len(self._k("worker", "")) :]

    def lease(self, model: str, shard: int) -> str:
        return self._k("lease", model, str(shard))

    def dead(self, model: str) -> str:
        return self._k("dead", model)

    def job_progress(self, job_id: str) -> str:
        """Hash of an offline job's progress: done, total, failed, rate, updated_at, state."""
        return self._k("job", job_id)

    def job_id_of(self, key: str | bytes) -> str:
        """The job id in a :meth:`job_progress` key."""
        text = key.decode() if isinstance(key, bytes) else key
        return text[len(self._k("job", "")) :]

    def reply(self, client_id: str) -> str:
        return self._k("reply", client_id)

    # -- one tenant's quota (its keys share the tenant's hash tag: one QUOTA script call) ------
    @property
    def quotas(self) -> str:
        return self._k("quotas")

    def quota(self, tenant: str) -> str:
        """The limits an operator set (``python -m worker.quota``); producers only read it."""
        return self._k("quota", f"{{{check_tenant(tenant)}}}")

    def quota_use(self, tenant: str) -> str:
        return self._k("quota", f"{{{check_tenant(tenant)}}}", "use")

    def quota_bucket(self, tenant: str) -> str:
        return self._k("quota", f"{{{check_tenant(tenant)}}}", "bucket")

    def quota_leases(self, tenant: str) -> str:
        return self._k("quota", f"{{{check_tenant(tenant)}}}", "leases")

    def lora_registry(self, model: str) -> str:
        return self._k("lora", model)

    def lora_file(self, model: str, name: str, content_hash: str) -> str:
        return self._k("lorafile", model, name, content_hash)

    # -- one shard -------------------------------------------------------------------------
    def stream(self, model: str, priority: str = "high", shard: int = 0, tenant: str = "") -> str:
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, not {priority!r}")
        if tenant:
            return self._tagged(model, shard, priority, check_tenant(tenant))
        return self._tagged(model, shard, priority)

    def streams(
        self,
        model: str,
        shards: int,
        priority: str | None = None,
        tenants: dict[int, list[str]] | None = None,
    ) -> list[str]:
        """Request streams of a model: every shard's interactive, then offline streams (or only
        those of ``priority``); with ``tenants`` (shard -> tenant names, see :meth:`tenants`),
        each shard's stream of no tenant followed by its tenants' streams."""
        kinds = PRIORITIES if priority is None else (priority,)
        return [
            self.stream(model, p, s, t)
            for p in kinds
            for s in range(shards)
            for t in ["", *(tenants or {}).get(s, [])]
        ]

    def tenants(self, model: str, shard: int) -> str:
        """Set of the tenants whose requests have a stream on ``shard`` (SUBMIT adds them)."""
        return self._tagged(model, shard, "tenants")

    def parse_stream(self, name: str | bytes) -> StreamName:
        """Model, shard, priority and tenant of a request stream's name."""
        text = name.decode() if isinstance(name, bytes) else name
        m = _STREAM.search(text[len(self.prefix) + 1 :])
        if not text.startswith(self.prefix + ":") or m is None:
            raise ValueError(f"{text!r} is not a request stream of prefix {self.prefix!r}")
        return StreamName(m["model"], int(m["shard"]), m["priority"], m["tenant"] or "")

    def stats(self, model: str, shard: int) -> str:
        return self._tagged(model, shard, "stats")

    def result(self, model: str, shard: int, digest: str) -> str:
        return self._tagged(model, shard, "res", digest)

    def due(self, model: str, shard: int) -> str:
        """Keys of ``shard`` kept without a TTL, and when each is due (``shared.scripts``)."""
        return self._tagged(model, shard, "due")

    def results(self, model: str) -> str:
        """SCAN pattern of every cached result of ``model`` (all shards)."""
        return self._k(f"{{{_glob_escape(model)}:*}}", "res", "*")

    def digest_prefixes(self, model: str, shard: int) -> tuple[str, str]:
        """Result and waiters key names of ``shard`` without the digest: the SUBMIT and
        FINISH scripts complete them (see ``shared.scripts``)."""
        return self.result(model, shard, ""), self.waiters(model, shard, "")

    def waiters(self, model: str, shard: int, digest: str) -> str:
        return self._tagged(model, shard, "wait", digest)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def request_digest(
    fingerprint: str, kind: str, ids: bytes, lora: str | None, params: bytes = b""
) -> str:
    """Content address of a request: equal inputs to the same model give the same digest.

    ``ids`` are the token ids as packed little-endian 32-bit integers (their wire form, so
    neither side converts them to hash them); ``params`` is the canonical encoding of
    kind-specific parameters (sampling settings, the continuation of a score request).
    """
    h = hashlib.blake2b(digest_size=20)
    for part in (fingerprint, kind, lora or ""):
        h.update(part.encode())
        h.update(b"\x00")
    h.update(ids)
    h.update(b"\x00")
    h.update(params)
    return h.hexdigest()


if __name__ == "__main__":
    print(key_table(), end="")
