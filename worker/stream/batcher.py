"""From stream entries to jobs: decode, validate, drop expired, merge duplicates, triage.

A job is one distinct request (a digest) with every entry that asked for it. Whatever can be
answered without the model is settled here: an undecodable message (dead-lettered, and its
digest's waiters told), invalid input (a typed error), a request whose deadline has passed
(``Expired``: nobody waits for it any more, so it costs no compute). Entries that waited in the
stream longer than ``TRIAGE_AFTER_MS`` (or were taken over from a dead consumer) are checked
against Redis first: a result that already exists is not computed again, and a request that
nobody waits for any more (its askers cancelled or timed out) is skipped. Fresh entries skip
that round trip: their askers are almost certainly still there.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared import protocol
from shared.errors import (
    Expired,
    InvalidRequest,
    LMPoolError,
    ProtocolError,
    WireError,
    error_to_wire,
)
from shared.keys import Keys, request_digest
from shared.protocol import Request
from shared.redis_conn import AnyRedis
from shared.registry import is_runtime_adapter
from shared.settings import Settings
from worker.backends.base import Backend, Work, check_ids
from worker.stream.reader import Entry

TRIAGE_AFTER_MS = 50
"""Entries older than this are checked for an existing result and for waiters before they run."""
_DIGEST = re.compile(r"^[0-9a-f]{40}$")


@dataclass(eq=False)
class Job:
    """One distinct request (a digest) and every stream entry that asked for it."""

    digest: str
    shard: int
    entries: list[Entry]
    request: Request | None = None
    work: Work | None = None
    result: protocol.Encoded | None = None
    """The encoded result, once computed (a row: in parts, ``protocol.encode_results``)."""
    error: WireError | None = None
    dead: str | None = None
    """Why its entries go to the dead-letter stream (None: they do not)."""
    outcome: str = "computed"
    """computed, cache_hit, skipped, error, expired, dead_letter (for logs and metrics)."""
    triage: bool = False
    """Check Redis for its result and waiters before computing it."""
    read_at: float = field(default_factory=time.monotonic)
    """When this worker read it (monotonic): one that waited here long is checked again."""

    @property
    def kind(self) -> str:
        return self.request["kind"] if self.request is not None else "?"

    @property
    def key(self) -> str:
        """What its duplicates share: the digest, in its shard (the same prompt asked with
        affinity keys of two shards is two jobs: each shard's cache and waiters get theirs)."""
        return job_key(self.shard, self.digest)

    @property
    def tenant(self) -> str:
        """The tenant of its first entry (the one that queued it); empty: no tenant."""
        return self.entries[0].tenant if self.entries else ""

    @property
    def shared(self) -> bool:
        """Its result goes into the shared cache (a cache_kv answer describes one worker)."""
        return self.result is not None and self.error is None and self.kind != "cache_kv"

    def fail(self, error: BaseException, outcome: str = "error") -> None:
        self.error = error_to_wire(error)
        self.outcome = outcome


def job_key(shard: int, digest: str) -> str:
    return f"{shard}/{digest}"


def valid_digest(value: str | None) -> str:
    """``value`` if it looks like a digest (so it can go into a key), else ``""``."""
    return value if value and _DIGEST.match(value) else ""


class Batcher:
    def __init__(self, backend: Backend, settings: Settings) -> None:
        self.backend = backend
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.model = settings.served_model_name

    def jobs(self, entries: list[Entry], now_ms: float, force_triage: bool = False) -> list[Job]:
        """Group entries into jobs; jobs settled here already carry their error."""
        jobs: dict[str, Job] = {}
        for entry in entries:
            try:
                if entry.raw is None:
                    raise ProtocolError("stream entry has no message field")
                req = protocol.decode_request(entry.raw, self.settings.max_message_bytes)
            except ProtocolError as e:
                self._undecodable(entry, str(e), jobs)
                continue
            job = jobs.get(job_key(entry.shard, req["digest"]))
            if job is not None:
                job.entries.append(entry)
                continue
            job = Job(req["digest"], entry.shard, [entry], req)
            jobs[job.key] = job
            try:
                self._validate(req)
            except LMPoolError as e:
                job.fail(e)
                continue
            if req["deadline_ms"] < now_ms:
                late_ms = now_ms - req["deadline_ms"]
                expired = Expired(f"dropped unrun: its deadline passed {late_ms:.0f} ms ago")
                job.fail(expired, "expired")
                continue
            job.triage = force_triage or now_ms - entry.added_ms > TRIAGE_AFTER_MS
            job.work = Work(
                req["kind"],
                np.frombuffer(req["ids"], "<i4").tolist(),
                req["lora"],
                req["params"],
                high=not entry.offline,
                tag=job,
            )
        return list(jobs.values())

    def _undecodable(self, entry: Entry, reason: str, jobs: dict[str, Job]) -> None:
        """Dead-letter the entry; the waiters of the digest it names (if any) get the reason."""
        digest = valid_digest(entry.digest)
        job = Job(digest, entry.shard, [entry], dead=reason)
        job.fail(ProtocolError(f"a worker could not decode the request: {reason}"), "dead_letter")
        jobs[f"dead:{entry.stream}:{entry.entry_id}"] = job

    def _validate(self, req: Request) -> None:
        kind, params, backend = req["kind"], req["params"], self.backend
        if kind not in protocol.KINDS:
            raise InvalidRequest(f"unknown request kind {kind!r}")
        ids = np.frombuffer(req["ids"], "<i4")
        check_ids(ids, backend.info["vocab_size"])
        if kind == "sample":
            check_sample_params(params, backend.info["vocab_size"])
        elif kind == "score":
            cont = params.get("cont")
            if set(params) - {"cont", "greedy"} or not isinstance(cont, list) or not cont:
                raise InvalidRequest(
                    "score needs a non-empty continuation and takes only greedy besides"
                )
            if not isinstance(params.get("greedy", False), bool):
                raise InvalidRequest(f"score's greedy must be a bool, got {params['greedy']!r}")
            check_ids(_int_array(cont), backend.info["vocab_size"])
        elif kind == "cache_kv":
            if set(params) - {"pin"} or not isinstance(params.get("pin", True), bool):
                raise InvalidRequest(f"cache_kv takes only pin (a bool), got {sorted(params)}")
        elif params:
            raise InvalidRequest(f"{kind} takes no parameters, got {sorted(params)}")
        # a run-time adapter is checked (and loaded) by the consumer, see worker.adapters
        lora = None if is_runtime_adapter(req["lora"]) else req["lora"]
        read, what = protocol.tokens_read(kind, len(ids), params)
        backend.check_prompt(read, lora, self.settings.max_prompt_tokens, what)
        expected = request_digest(
            backend.info["fingerprint"],
            kind,
            req["ids"],
            req["lora"],
            protocol.canonical_params(kind, params),
        )
        if expected != req["digest"]:
            raise InvalidRequest(
                "request digest does not match its content for this worker's model "
                f"(fingerprint {backend.info['fingerprint']}): the producer sees other model "
                "metadata; reconnect it"
            )

    async def triage(self, redis: AnyRedis, jobs: list[Job]) -> None:
        """One round trip for the jobs that need it: does the result exist, does anyone wait?"""
        todo = [j for j in jobs if j.triage and j.error is None]
        if not todo:
            return
        pipe = redis.pipeline(transaction=False)
        for job in todo:
            pipe.exists(self.keys.result(self.model, job.shard, job.digest))
            pipe.scard(self.keys.waiters(self.model, job.shard, job.digest))
        answers = await pipe.execute()
        for i, job in enumerate(todo):
            exists, waiting = answers[2 * i], answers[2 * i + 1]
            job.triage = False
            if exists and job.kind != "cache_kv":
                job.outcome = "cache_hit"
                job.work = None
            elif not waiting:
                job.outcome = "skipped"  # every asker timed out or cancelled
                job.work = None


def _int_array(values: list[Any]) -> np.ndarray:
    if not all(type(v) is int for v in values):
        raise InvalidRequest("token ids must be integers")
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        raise InvalidRequest("token id out of range") from None


def check_sample_params(params: dict[str, Any], vocab_size: int) -> None:
    max_tokens, eos = params.get("max_tokens"), params.get("eos")
    temperature, seed = params.get("temperature"), params.get("seed")
    if type(max_tokens) is not int or not 0 <= max_tokens <= protocol.MAX_SAMPLE_TOKENS:
        raise InvalidRequest(
            f"max_tokens must be an int in [0, {protocol.MAX_SAMPLE_TOKENS}], got {max_tokens!r}"
        )
    if not isinstance(eos, list) or not all(type(t) is int for t in eos):
        raise InvalidRequest("eos_token_ids must be a list of ints")
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise InvalidRequest(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    if seed is not None and type(seed) is not int:
        raise InvalidRequest(f"seed must be an int or None, got {seed!r}")
    if set(params) - {"max_tokens", "eos", "temperature", "seed"}:
        raise InvalidRequest(f"unknown sample parameters {sorted(params)}")
