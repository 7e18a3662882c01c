"""A tenant's quota, as a producer's calls meet it: admitted whole before anything is queued,
or refused with :class:`~shared.errors.QuotaExceeded` (or waited for, with ``quota_wait``).

An operator sets a tenant's limits (``python -m worker.quota``): requests in flight and prompt
tokens per second, shared by every producer of the tenant. Before a call's requests go to
SUBMIT, one QUOTA script call (``shared.scripts``) admits all of them or none: each admitted
request holds a lease in the tenant's lease set until its answer comes (or its call fails or is
cancelled), and a lease whose producer died ends when its request would have timed out. A
tenant with no quota set costs one QUOTA call a second per producer, whatever its rate; a
producer with no tenant, none.

Quotas are kept by this library: a client that writes its tenant's streams by other means
skips them (the workers' fair shares still hold it to its weight).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import Any

from redis.exceptions import NoScriptError

from producer.background import KEEP
from producer.submit import Prepared
from producer.target import Target
from shared.errors import QuotaExceeded, RequestTimeout
from shared.redis_conn import TRANSIENT, Backoff, connect_redis_sync
from shared.scripts import QUOTA_SCRIPT, run_script

log = logging.getLogger("lmpool.producer")
NO_QUOTA_RECHECK_S = 1.0
"""How long a producer believes that its tenant has no quota before asking again."""
WAIT_FIRST_S, WAIT_MOST_S = 0.002, 0.05
"""A waiting call asks again after these (doubling) while the in-flight limit holds it; the
token limit says itself when enough tokens will be there."""
LEASE_GRACE_MS = 5_000
"""A lease outlives its request's timeout by this much (the SUBMIT waiter's margin too)."""


def prompt_tokens(p: Prepared) -> int:
    """Tokens the model reads for ``p``: the prompt, and a score's continuation."""
    return len(p.request["ids"]) // 4 + len(p.request["params"].get("cont", ()))


class QuotaGate:
    """Admits a producer's calls under its tenant's quota (one gate per ``PoolClient``)."""

    def __init__(self, target: Target, wait: bool = False) -> None:
        self.target = target
        self.wait = wait
        self.quota_set = False
        """Whether the last QUOTA answer found a quota for this tenant: every call asks."""
        self.none_until = 0.0 if target.tenant else float("inf")
        """Until then, calls go without asking: no quota was set a second ago."""
        self.asking_until = 0.0
        """While a call asks whether a quota is set, the others wait for its answer."""
        self._asked: asyncio.Future[None] | None = None
        """Done when the asking call (of an event loop) has its answer."""
        self.held: set[str] = set()
        """Leases of this producer's calls in flight (a close ends them all at once)."""
        self.ids = itertools.count()
        """Lease numbers of this producer (its client id makes them unique in the pool)."""
        k, tenant = target.keys, target.tenant
        self.limits = k.quota(tenant) if tenant else ""
        self.keys = (
            [k.quota_use(tenant), k.quota_leases(tenant), k.quota_bucket(tenant)] if tenant else []
        )

    def skips(self) -> bool:
        """Whether a call goes now without asking (no quota a moment ago): a cheap check."""
        return not self.quota_set and time.monotonic() < self.none_until

    def _next(self) -> str:
        """What a call does now: ``skip`` (no quota, as asked at most a second ago), ``ask``
        (run QUOTA: its answer also says whether a quota is set), or ``wait`` (another call is
        asking whether one is set: a burst of calls asks once, not once each)."""
        now = time.monotonic()
        if self.quota_set:
            return "ask"
        if now < self.none_until:
            return "skip"
        if now < self.asking_until:
            return "wait"
        self.asking_until = now + NO_QUOTA_RECHECK_S  # this call asks; a lost answer frees it
        return "ask"

    def _learn(self, a: Admission) -> None:
        """What the asking call found; its waiters go on."""
        self.quota_set = not a.no_quota
        self.none_until = time.monotonic() + NO_QUOTA_RECHECK_S if a.no_quota else 0.0
        self.asking_until = 0.0
        asked, self._asked = self._asked, None
        if asked is not None:
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody waits
                asked.get_loop().call_soon_threadsafe(_done, asked)

    async def admit(self, redis: Any, prepared: list[Prepared], timeout_s: float) -> list[str]:
        """The leases of ``prepared``, admitted together (``[]``: no quota applies)."""
        loop = asyncio.get_running_loop()
        while (step := self._next()) == "wait":
            asked = self._asked
            if asked is not None and asked.get_loop() is loop:
                await asyncio.shield(asked)
            else:  # asked from another loop or thread
                await asyncio.sleep(WAIT_FIRST_S / 2)
        if step == "skip":
            return []
        if not self.quota_set:  # the calls of this loop that come meanwhile wait for this one
            self._asked = loop.create_future()
        a = Admission(self, prepared, timeout_s)
        try:
            while True:
                try:
                    reply = await _run(redis, self.keys, a.args())
                except TRANSIENT as e:  # Redis restarting: asked again within the timeout
                    await asyncio.sleep(a.unreachable(e))
                    continue
                if (delay := a.answer(reply)) <= 0:
                    break
                self._learn(a)
                await asyncio.sleep(delay)
        except QuotaExceeded:
            if self.wait:  # its tries were not counted: the refusal is, once
                await redis.hincrby(self.keys[0], "refused", len(prepared))
            raise
        finally:  # a refusal, an answer, or no answer at all (then every call asks)
            self._learn(a)
        self.held.update(a.leases)
        return a.leases

    def admit_sync(self, redis: Any, prepared: list[Prepared], timeout_s: float) -> list[str]:
        """:meth:`admit`, blocking, with a synchronous client."""
        while (step := self._next()) == "wait":
            time.sleep(WAIT_FIRST_S / 2)
        if step == "skip":
            return []
        a = Admission(self, prepared, timeout_s)
        try:
            while True:
                try:
                    reply = _run_sync(redis, self.keys, a.args())
                except TRANSIENT as e:
                    time.sleep(a.unreachable(e))
                    continue
                if (delay := a.answer(reply)) <= 0:
                    break
                self._learn(a)
                time.sleep(delay)
        except QuotaExceeded:
            if self.wait:
                redis.hincrby(self.keys[0], "refused", len(prepared))
            raise
        finally:
            self._learn(a)
        self.held.update(a.leases)
        return a.leases

    def release(self, redis: Any, leases: list[str]) -> None:
        """End ``leases`` in the background of the running loop (a cancelled call's too)."""
        if not leases:
            return
        self.held.difference_update(leases)
        task = asyncio.get_running_loop().create_task(redis.zrem(self.keys[1], *leases))
        KEEP.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            KEEP.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning(
                    "quota leases not released (%r): they end at their expiry instead",
                    t.exception(),
                )

        task.add_done_callback(done)

    def release_sync(self, redis: Any, leases: list[str]) -> None:
        if leases:
            self.held.difference_update(leases)
            try:
                redis.zrem(self.keys[1], *leases)
            except TRANSIENT as e:  # the call's answer stands
                log.warning("quota leases not released (%r): they end at their expiry instead", e)

    async def release_all(self, redis: Any) -> None:
        """End every lease still held (the producer closes: its calls in flight fail)."""
        held, self.held = list(self.held), set()
        if held:
            await redis.zrem(self.keys[1], *held)

    def release_all_sync(self, redis_url: str) -> None:
        """:meth:`release_all` through a connection of its own: a producer closed with no
        event loop's client at hand (blocking calls in flight, ``close_sync``)."""
        if self.held:
            redis = connect_redis_sync(redis_url)
            try:
                self.release_sync(redis, list(self.held))
            finally:
                redis.close()


class Admission:
    """One call's way through the quota, without I/O: the QUOTA script's arguments for each try,
    and what its answer means (admitted, refused, or wait and try again)."""

    def __init__(self, gate: QuotaGate, prepared: list[Prepared], timeout_s: float) -> None:
        self.gate, self.prepared, self.timeout_s = gate, prepared, timeout_s
        self.tokens = sum(prompt_tokens(p) for p in prepared)
        self.started = time.monotonic()
        self.pause = WAIT_FIRST_S
        self.leases: list[str] = []
        self.lost: Exception | None = None
        """Why the last try got no answer (Redis unreachable): the next keeps its lease ids."""
        self.backoff = Backoff()
        self.no_quota = False
        """The last answer: no quota is set for the tenant (nothing asked yet: False)."""

    def args(self) -> list[Any]:
        """The next try's arguments, with fresh lease ids."""
        ids = self.gate.ids
        if self.lost is None or not self.leases:  # a lost answer's leases may have been added
            self.leases = [f"{self.gate.target.client_id}:{next(ids)}" for _ in self.prepared]
        self.lost = None
        lease_ms = int(self.timeout_s * 1000) + LEASE_GRACE_MS
        counted = "0" if self.gate.wait else "1"  # a waiting call counts its refusal itself
        return [self.gate.limits, lease_ms, self.tokens, counted, *self.leases]

    def unreachable(self, error: Exception) -> float:
        """Seconds to wait before asking again, Redis having not answered (``error``); past
        the call's timeout, ``RequestTimeout`` naming it."""
        self.lost = error
        left = self.timeout_s - (time.monotonic() - self.started)
        if left <= 0:
            raise RequestTimeout(
                f"tenant {self.gate.target.tenant!r}'s quota could not be read within "
                f"{self.timeout_s:g}s: Redis unreachable ({error!r})"
            )
        return min(self.backoff.step(), left)

    def answer(self, reply: Any) -> float:
        """0 when the call may go (:attr:`leases` hold its leases, ``[]`` if no quota is set);
        else seconds to wait before the next try. Raises ``QuotaExceeded`` for a refusal that
        does not wait."""
        code, retry_ms = int(reply[0]), int(reply[1])
        self.no_quota = code == 3
        if code == 0:
            return 0.0
        if code == 3:
            self.leases = []
            return 0.0
        delay = retry_ms / 1000 or self.pause
        self.pause = min(2 * self.pause, WAIT_MOST_S)
        tenant, n = self.gate.target.tenant, len(self.prepared)
        if code == 4:
            raise QuotaExceeded(
                f"a call of {n} requests can never run under tenant {tenant!r}'s quota of "
                "requests in flight (python -m worker.quota shows it): split the call"
            )
        waited = time.monotonic() - self.started
        if self.gate.wait and waited + delay < self.timeout_s:
            return delay
        if code == 1:
            why = f"tenant {tenant!r} has as many requests in flight as its quota allows"
        else:
            why = (
                f"tenant {tenant!r} is over its quota of prompt tokens per second "
                f"(this call: {self.tokens} tokens; room in {retry_ms} ms)"
            )
        after = f" after waiting {waited:.1f}s" if self.gate.wait else ""
        raise QuotaExceeded(
            f"{why}: the call of {n} request(s) was not queued{after}",
            retry_after_s=retry_ms / 1000,
        )


def _done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _run(redis: Any, keys: list[str], args: list[Any]) -> Any:
    return await run_script(redis, QUOTA_SCRIPT, keys, args)


def _run_sync(redis: Any, keys: list[str], args: list[Any]) -> Any:
    try:
        return redis.evalsha(QUOTA_SCRIPT.sha, len(keys), *keys, *args)
    except NoScriptError:
        QUOTA_SCRIPT.load_sync(redis)
        return redis.evalsha(QUOTA_SCRIPT.sha, len(keys), *keys, *args)
