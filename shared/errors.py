"""Typed errors shared by producers and workers.

Every failure that crosses the wire travels as ``{"code": ..., "message": ...}`` and is turned
back into one of these classes on the producer, so callers can ``except`` precisely.
"""

from __future__ import annotations

from typing import TypedDict


class WireError(TypedDict):
    """An error on the wire."""

    code: str
    """Error class code (``LMPoolError.code`` of the class to raise)."""
    message: str
    """What went wrong, for people."""


class LMPoolError(Exception):
    """Base class of every error lmpool raises."""

    code = "internal"


class SettingsError(LMPoolError, ValueError):
    """A setting is missing, misspelled or out of range (raised at start-up)."""

    code = "settings"


class InvalidRequest(LMPoolError, ValueError):
    """The request itself is wrong: empty, out-of-vocabulary or too-long token ids, bad params."""

    code = "invalid_request"


class UnknownAdapter(InvalidRequest):
    """The LoRA adapter named by the request is not loaded on the workers."""

    code = "unknown_adapter"


class ProtocolError(LMPoolError):
    """A message could not be decoded: malformed, truncated, oversized or of another version."""

    code = "protocol"


class NoWorker(LMPoolError, TimeoutError):
    """No live worker serves the requested model."""

    code = "no_worker"


class RequestTimeout(LMPoolError, TimeoutError):
    """A request got no answer within its timeout."""

    code = "timeout"


class Expired(RequestTimeout):
    """A worker dropped the request unanswered: its deadline had passed before it could run.

    A producer that still waits for the digest (a later asker's deadline) submits it again."""

    code = "expired"


class QueueFull(LMPoolError):
    """The model's request stream is longer than ``LMPOOL_MAX_QUEUE``: back off and retry."""

    code = "queue_full"


class QuotaExceeded(LMPoolError):
    """The call would take its tenant past a quota (requests in flight, prompt tokens per
    second): nothing of it was queued. Retry after ``retry_after_s``, or connect with
    ``quota_wait=True`` (``LMPOOL_QUOTA_WAIT``) to wait for room instead."""

    code = "quota_exceeded"

    def __init__(self, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RedisFull(LMPoolError):
    """Redis refused a write (``OOM``): its used memory is above ``maxmemory`` and its
    ``maxmemory-policy`` finds nothing to evict (``noeviction``; under ``volatile-*``, no key
    with a TTL). The request is not queued. Raise ``maxmemory``, or let Redis evict cached
    results (``maxmemory-policy volatile-lru``; README, "Redis memory")."""

    code = "redis_full"


class PoolUnreachable(LMPoolError, ConnectionError):
    """The pool's Redis does not answer: refused, timed out, or the credentials are refused."""

    code = "unreachable"


class WorkerError(LMPoolError, RuntimeError):
    """The worker failed while computing the request (the model raised)."""

    code = "worker"


class DeadLettered(WorkerError):
    """The request was delivered ``LMPOOL_MAX_DELIVERIES`` times without an answer."""

    code = "dead_letter"


_BY_CODE: dict[str, type[LMPoolError]] = {
    cls.code: cls
    for cls in (
        LMPoolError,
        SettingsError,
        InvalidRequest,
        UnknownAdapter,
        ProtocolError,
        NoWorker,
        RequestTimeout,
        Expired,
        QueueFull,
        QuotaExceeded,
        RedisFull,
        PoolUnreachable,
        WorkerError,
        DeadLettered,
    )
}


def error_from_wire(code: str, message: str) -> LMPoolError:
    """Rebuild the typed error a worker sent; unknown codes become ``LMPoolError``."""
    return _BY_CODE.get(code, LMPoolError)(message)


def error_to_wire(exc: BaseException) -> WireError:
    """The wire form of an exception: lmpool errors keep their code and message (the producer
    raises the same class again, so the message does not repeat its name); others become
    ``worker``, their class named in the message (``RuntimeError: ...``)."""
    if isinstance(exc, LMPoolError):
        return {"code": exc.code, "message": str(exc)}
    return {"code": WorkerError.code, "message": f"{type(exc).__name__}: {exc}"}
