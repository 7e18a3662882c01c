"""Taking over the messages of dead consumers, and dead-lettering the ones that keep failing.

A message read by a consumer that then dies stays pending in the group. Every worker scans the
pending lists periodically: a message idle past ``LMPOOL_CLAIM_AFTER_S`` is claimed (XCLAIM
with the same idle bound, so two scanners never both take it) and answered; one already
delivered ``LMPOOL_MAX_DELIVERIES`` times is moved to the dead-letter stream and its waiters
get a ``DeadLettered`` error instead of a hang.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from shared import protocol
from shared.errors import DeadLettered, ProtocolError, error_to_wire
from shared.keys import GROUP
from worker.consumer import Consumer, Entry, Job

log = logging.getLogger("lmpool.worker")


async def reclaim_once(consumer: Consumer) -> int:
    """One scan of every stream; returns how many messages were queued for taking over."""
    s = consumer.settings
    idle_ms = int(s.claim_after_s * 1000)
    taken = 0
    for stream in consumer.streams:
        pending = await consumer.redis.xpending_range(
            stream, GROUP, min="-", max="+", count=4 * s.max_batch, idle=idle_ms
        )
        pending = [p for p in pending if _s(p["consumer"]) != consumer.name]
        if not pending:
            continue
        retry = [_s(p["message_id"]) for p in pending if p["times_delivered"] < s.max_deliveries]
        doomed = {
            _s(p["message_id"]): p["times_delivered"]
            for p in pending
            if p["times_delivered"] >= s.max_deliveries
        }
        if retry:
            consumer.add_reclaimable(stream, retry)
            taken += len(retry)
        if doomed:
            claimed = await consumer.claim(stream, list(doomed))
            await dead_letter(consumer, claimed, doomed)
    return taken


async def dead_letter(consumer: Consumer, entries: list[Entry], deliveries: dict[str, int]) -> None:
    """Answer each entry's waiters with ``DeadLettered``, record it, acknowledge it."""
    jobs: list[Job] = []
    dead: list[tuple[Entry, str]] = []
    for entry in entries:
        reason = (
            f"request was delivered {deliveries.get(entry.entry_id, '?')} times and never "
            "answered (each time its worker died): it may crash the model"
        )
        try:
            if entry.raw is None:
                raise ProtocolError("no message")
            req = protocol.decode_request(entry.raw, consumer.settings.max_message_bytes)
        except ProtocolError:
            dead.append((entry, reason))
            continue
        job = Job(req["digest"], req, [])
        job.error = error_to_wire(DeadLettered(reason))
        jobs.append(job)
        dead.append((entry, reason))
    await consumer._write(jobs, dead)


async def reclaim_loop(consumer: Consumer, stopping: asyncio.Event) -> None:
    period = min(max(consumer.settings.claim_after_s / 2, 0.2), 10.0)
    while not stopping.is_set():
        try:
            await asyncio.wait_for(stopping.wait(), timeout=period)
        except asyncio.TimeoutError:
            pass
        if stopping.is_set():
            return
        try:
            await reclaim_once(consumer)
        except Exception:
            log.exception("reclaim scan failed; retrying next period")


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
