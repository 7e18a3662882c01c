"""Taking over the messages of dead consumers, and dead-lettering the ones that keep failing.

A message read by a consumer that then dies stays pending in the group. Every worker scans the
pending lists periodically: a message idle past ``LMPOOL_CLAIM_AFTER_S`` is queued to be
claimed (XCLAIM with the same idle bound, so two scanners never both take it) and run alone;
one already delivered ``LMPOOL_MAX_DELIVERIES`` times is moved to the dead-letter stream and its
waiters get a ``DeadLettered`` error instead of a hang.

A live worker keeps what it holds from looking dead: every heartbeat (more often when
``LMPOOL_CLAIM_AFTER_S`` is under four heartbeats: ``Settings.renew_s``) it claims its held
entries again (``renew_held``: XCLAIM ... JUSTID, no delivery counted), which sets their idle
time to zero. So a long generation, or a request read ahead behind one, is neither taken over
by another worker nor queued again by its producer's re-submission (the SUBMIT script reads
the same idle time); a worker whose model is stuck in one step stops renewing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

from redis.exceptions import ResponseError

from shared.aio import OutageLog, wait_event
from shared.keys import GROUP
from shared.redis_conn import TRANSIENT
from shared.scripts import FORGET_SCRIPT, execute, run_script
from worker.stream.consumer import Consumer
from worker.stream.reader import stream_gone

log = logging.getLogger("lmpool.worker")


async def reclaim_once(consumer: Consumer) -> int:
    """One scan of every stream; returns how many messages were queued for taking over."""
    s = consumer.settings
    idle_ms = int(s.claim_after_s * 1000)
    taken = 0
    for stream in consumer.streams:
        await forget_consumers(consumer, stream, idle_ms)
        pending = await consumer.redis.xpending_range(
            stream, GROUP, min="-", max="+", count=4 * s.max_batch, idle=idle_ms
        )
        # this worker's own entries too, if it does not hold them: after a failover to a replica
        # that missed an acknowledgement, an answered entry is pending here, forgotten
        held = consumer.held_entries()
        pending = [
            p
            for p in pending
            if _s(p["consumer"]) != consumer.name or _s(p["message_id"]) not in held
        ]
        if not pending:
            continue
        retry = [_s(p["message_id"]) for p in pending if p["times_delivered"] < s.max_deliveries]
        doomed = {
            _s(p["message_id"]): p["times_delivered"]
            for p in pending
            if p["times_delivered"] >= s.max_deliveries
        }
        if retry:
            delivered = {_s(p["message_id"]): int(p["times_delivered"]) for p in pending}
            new = consumer.add_reclaimable(stream, retry, delivered)
            if new:
                owners = sorted({_s(p["consumer"]) for p in pending if _s(p["message_id"]) in new})
                log.warning(
                    "taking over %d entr%s of %s on %s, idle past LMPOOL_CLAIM_AFTER_S=%gs "
                    "(a dead or stuck worker): %s; each runs alone when this worker is free",
                    len(new),
                    "y" if len(new) == 1 else "ies",
                    ", ".join(owners),
                    stream,
                    s.claim_after_s,
                    _ids(new),
                )
            taken += len(retry)
        if doomed:
            claimed = await consumer.reader.claim(stream, list(doomed))
            await consumer.dead_letter(claimed, doomed)
    return taken


async def forget_consumers(consumer: Consumer, stream: str, idle_ms: int) -> int:
    """Take out of ``stream``'s group the other consumers idle past ``idle_ms`` (a live
    worker reads every second at least) that hold nothing: stopped or dead workers' (one
    holding entries stays until they are taken over). Returns how many."""
    idle = [
        _s(c["name"])
        for c in await consumer.redis.xinfo_consumers(stream, GROUP)
        if c["pending"] == 0 and c["idle"] >= idle_ms and _s(c["name"]) != consumer.name
    ]
    if not idle:
        return 0
    return int(await run_script(consumer.redis, FORGET_SCRIPT, [stream], [GROUP, *idle]))


async def leave_groups(consumer: Consumer) -> None:
    """A stopping worker's last word on the streams: out of their groups, where it holds
    nothing (what it could not acknowledge stays pending under its name, to be taken over)."""

    def build(pipe: Any) -> None:
        for stream in consumer.streams:
            FORGET_SCRIPT.queue(pipe, [stream], [GROUP, consumer.name])

    await execute(consumer.redis, build, [FORGET_SCRIPT], raise_on_error=False)


async def renew_held(consumer: Consumer) -> int:
    """Claim again the entries this worker holds that have waited half a renewal period
    (``Settings.renew_s``) since it last did, unless one step of its model has run past
    ``LMPOOL_CLAIM_AFTER_S``; returns how many. Only entries still pending on this consumer:
    one taken over meanwhile stays taken."""
    s = consumer.settings
    if consumer.compute.stuck_s() > s.claim_after_s:
        return 0
    held: dict[str, set[str]] = defaultdict(set)
    for stream, entry_id in consumer.held():
        held[stream].add(entry_id)
    if not held:
        return 0
    idle_ms = int(s.renew_s * 500)
    streams = list(held)
    pipe = consumer.redis.pipeline(transaction=False)
    for stream in streams:
        pipe.xpending_range(
            stream, GROUP, min="-", max="+", count=len(held[stream]) + 256,
            consumername=consumer.name, idle=idle_ms,
        )  # fmt: skip
    replies = await pipe.execute(raise_on_error=False)
    pipe = consumer.redis.pipeline(transaction=False)
    renewed = 0
    for stream, pending in zip(streams, replies, strict=True):
        if isinstance(pending, Exception):
            continue  # the stream or its group vanished: the reader recreates them
        ids = [i for i in (_s(p["message_id"]) for p in pending) if i in held[stream]]
        if ids:
            pipe.xclaim(stream, GROUP, consumer.name, idle_ms, list[Any](ids), justid=True)
            renewed += len(ids)
    if renewed:
        await pipe.execute(raise_on_error=False)
    return renewed


async def renew_loop(consumer: Consumer, stopping: asyncio.Event) -> None:
    """``renew_held`` every ``Settings.renew_s`` until ``stopping`` (the consumer's end: a
    stopping worker still renews what it finishes)."""
    outage = OutageLog(log, "to claim held entries again")
    while not stopping.is_set():
        await wait_event(stopping, consumer.settings.renew_s)
        if stopping.is_set():
            return
        try:
            await renew_held(consumer)
            outage.answered()
        except TRANSIENT as e:
            outage.failed(e, "next period")
        except Exception:
            log.exception("claiming held entries again failed; retrying next period")


async def reclaim_loop(consumer: Consumer, stopping: asyncio.Event) -> None:
    period = min(max(consumer.settings.claim_after_s / 2, 0.2), 10.0)
    outage = OutageLog(log, "for the reclaim scan")
    while not stopping.is_set():
        await wait_event(stopping, period)
        if stopping.is_set():
            return
        try:
            await reclaim_once(consumer)
            outage.answered()
        except ResponseError as e:
            if not stream_gone(e):
                log.exception("reclaim scan failed; retrying next period")
                continue
            log.warning("request streams vanished (%s): creating them again", e)
            await consumer.ensure_groups()
        except TRANSIENT as e:
            outage.failed(e, "next period")
        except Exception:
            log.exception("reclaim scan failed; retrying next period")


def _ids(entry_ids: list[str], most: int = 8) -> str:
    """Entry ids for a log line: the first ``most``, then how many more."""
    shown = " ".join(entry_ids[:most])
    return shown if len(entry_ids) <= most else f"{shown} and {len(entry_ids) - most} more"


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
