"""Lua scripts that make the request path atomic (keys come from ``shared.keys``).

SUBMIT (producer) and FINISH (worker) together guarantee that a waiting producer is answered
exactly when its result exists. The worker SETs the result, then runs FINISH, which takes the
digest's waiter set: a SUBMIT before the SET is in that set, one after it finds the result. A
digest is queued once however many producers ask for it. Each call handles a whole batch of one
shard (every key it names carries the shard's hash tag), not one request.

On a single Redis, FINISH also pushes the replies (their lists are keys it does not declare,
which a cluster refuses); on a cluster it returns the reply lists and the worker pushes them
in its next pipeline. The result itself never passes through Lua: moving a 200 KB value in and
out of a script costs Redis several times the CPU of a plain SET (``bench/reply_paths.py``).
Nothing a request waits on has a TTL, so that a Redis evicting under ``maxmemory``
(``volatile-lru`` takes only keys with a TTL) takes cached results, never a request's state: a
waiter set is created without one (FINISH deletes it), and a result is written without one until
its first read (``GETEX ... PX``) gives it its TTL. Each such key is filed in its shard's ``due``
set, a digest's result as ``r:D``, its waiter set as ``w:D``, with the time after which nobody
waits on it any more; SWEEP, run by every worker each heartbeat, gives a due result its TTL and
deletes a due waiter set (every asker's deadline has passed), so nothing stays forever.

Scripts are called by SHA in pipelines (``Script.queue``) and loaded once, again on NOSCRIPT:
redis-py's own Script objects add a ``SCRIPT EXISTS`` round trip to every pipeline.
"""

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from shared.keys import GROUP, Keys
from shared.redis_conn import load_script, load_script_sync, moving_slot
from shared.resp import Commands, RespConnection

SUBMIT = """
-- One call per shard for every request a producer sends on one event-loop tick.
-- KEYS: the shard's stats hash, its stream (the tenant's), its due set, its tenants set. The
-- digests' own keys are named inside: every key of a shard carries the shard's hash tag, so
-- they share the declared keys' slot.
-- ARGV: result and waiters key prefixes (a digest completes each), reply list, wait ms (how
--       long an asker may wait), max queue, marker, tenant ('' for none: then KEYS[4] is not
--       touched), the workers' group, stale ms, then per request: digest, force, message
--       (marker: pushed onto the reply list when a request was not queued or joined, so that
--       a pop of that list queued behind this call returns at once; '' pushes nothing)
--       (force: '0' for a first submission. Else a re-submission of a request unanswered for
--       a while: '1' adds the message again even if the digest is queued; 'j' (an asker that
--       joined another's entry, whose id it does not know) only if the stream is gone (else
--       that entry's own asker re-adds it if its worker died, or workers take it over after
--       LMPOOL_CLAIM_AFTER_S); an entry id (one this call returned to the same asker) adds it
--       again only if that entry, in KEYS[2],
--       is pending on a worker that has not claimed it again for stale ms (a live worker does
--       so every heartbeat: that one died), or if the stream is gone. An entry not pending
--       has not been delivered yet: it waits in the stream (a Redis that lost it lost the
--       waiter set with it, so the digest is queued anew as a first submission).)
-- A digest is queued while its waiter set exists: the first asker creates it (without a TTL,
-- due when the last asker's wait ends), FINISH deletes it; an asker that finds it joins.
-- A tenant's counters go into the stats hash twice: the shard's total and '<counter>:<tenant>'.
-- Returns one code per request: 1 the result exists, 0 joined, 2 the queue is full, or the
-- id of the entry it added (queued).
local res, wait = ARGV[1], ARGV[2]
local reply, wttl, maxq, marker = ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6]
local tenant, group, stale = ARGV[7], ARGV[8], tonumber(ARGV[9])
local out = {}
local hits, queued, joined, rejected = 0, 0, 0, 0
local len = nil
local t = redis.call('TIME')
local due = t[1] * 1000 + math.floor(t[2] / 1000) + tonumber(wttl)
local function again(force)
  -- whether a re-submission adds its message again (see force above), and the deliveries
  -- the new entry carries (field 'k') and the entry it replaces: one whose holder died, with
  -- its deliveries, acknowledged and deleted once the new one is added (taken over later, it
  -- would run twice), so that a prompt that kills its workers reaches LMPOOL_MAX_DELIVERIES
  -- however often it is submitted again
  if force == '0' then return false, 0 end
  if force == '1' then return true, 0 end
  if force == 'j' then return redis.call('EXISTS', KEYS[2]) == 0, 0 end
  local held = redis.pcall('XPENDING', KEYS[2], group, force, force, 1)
  if type(held) ~= 'table' or held.err then
    -- no group yet (a new tenant's stream, which workers find within a moment; they read it
    -- from its start), or no stream any more (deleted with the entry)
    return redis.call('EXISTS', KEYS[2]) == 0, 0
  end
  if held[1] == nil or tonumber(held[1][3]) < stale then return false, 0 end
  local carried = tonumber(held[1][4])
  local old = redis.call('XRANGE', KEYS[2], force, force)
  if old[1] then
    for j = 1, #old[1][2], 2 do
      if old[1][2][j] == 'k' then carried = carried + tonumber(old[1][2][j + 1]) end
    end
  end
  return true, carried, force
end
for i = 10, #ARGV, 3 do
  local d = ARGV[i]
  local w = wait .. d
  local code = 0
  if redis.call('EXISTS', res .. d) == 1 then
    hits = hits + 1
    code = 1
  else
    local first = redis.call('EXISTS', w) == 0  -- nothing queued it yet
    redis.call('SADD', w, reply)
    redis.call('ZADD', KEYS[3], 'GT', due, 'w:' .. d)
    local add, carried, replaced = first, 0, nil
    if not first then add, carried, replaced = again(ARGV[i + 1]) end
    if add then
      if len == nil then len = redis.call('XLEN', KEYS[2]) end
      if len >= maxq then
        redis.call('SREM', w, reply)
        rejected = rejected + 1
        code = 2
      else
        if carried > 0 then
          code = redis.call('XADD', KEYS[2], '*', 'm', ARGV[i + 2], 'd', d, 'k', carried)
        else
          code = redis.call('XADD', KEYS[2], '*', 'm', ARGV[i + 2], 'd', d)
        end
        if replaced then
          redis.call('XACK', KEYS[2], group, replaced)
          redis.call('XDEL', KEYS[2], replaced)
        end
        len = len + 1
        queued = queued + 1
      end
    else
      joined = joined + 1
    end
  end
  out[#out + 1] = code
end
local counts = {cache_hits = hits, queued = queued, joined = joined, rejected = rejected}
for name, n in pairs(counts) do
  if n > 0 then
    redis.call('HINCRBY', KEYS[1], name, n)
    if tenant ~= '' then redis.call('HINCRBY', KEYS[1], name .. ':' .. tenant, n) end
  end
end
if queued > 0 and tenant ~= '' then redis.call('SADD', KEYS[4], tenant) end
if marker ~= '' and hits + rejected > 0 then
  redis.call('RPUSH', reply, marker)
  redis.call('PEXPIRE', reply, wttl)
end
return out
"""

FINISH = """
-- One call per shard for a batch of finished digests, run after their results are SET.
-- KEYS: the shard's stats hash (for its slot; the digests' keys share it, see SUBMIT), its
--       due set
-- ARGV: push (1: push each reply here; 0: return the reply lists), reply ttl ms, waiters key
--       prefix, then per digest: digest, reply
-- Takes each digest's waiter set: a SUBMIT before the SET is in it, one after finds the result.
-- (The waiter set leaves the due set with it: it will not stay.)
-- Every set is read before any is deleted: a key Redis refuses (its slot moving to another
-- node: "non local key") fails the call before it has changed anything (a script's writes
-- stay when it fails), not after it took sets whose askers it then never names.
local push, ttl, wait = ARGV[1] == '1', ARGV[2], ARGV[3]
local out, sets = {}, {}
for i = 4, #ARGV, 2 do sets[i] = redis.call('SMEMBERS', wait .. ARGV[i]) end
for i = 4, #ARGV, 2 do
  local w = wait .. ARGV[i]
  local ws = sets[i]
  redis.call('DEL', w)
  redis.call('ZREM', KEYS[2], 'w:' .. ARGV[i])
  if push then
    for _, r in ipairs(ws) do
      redis.call('RPUSH', r, ARGV[i + 1])
      redis.call('PEXPIRE', r, ttl)
    end
    out[#out + 1] = #ws
  else
    out[#out + 1] = ws
  end
end
return out
"""

SWEEP = """
-- The keys of one shard that nobody waits on any more, once due: a result unread by its
-- askers (they died or gave up) gets its TTL, a waiter set is deleted.
-- KEYS: the shard's due set (member -> due time, ms on the Redis clock)
-- ARGV: result and waiters key prefixes, result ttl ms, most to take in this call
-- Returns how many members it took (a call that takes the most may leave more).
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[4]))
for _, m in ipairs(due) do
  local d = string.sub(m, 3)
  if string.sub(m, 1, 1) == 'r' then
    redis.call('PEXPIRE', ARGV[1] .. d, ARGV[3], 'NX')
  else
    redis.call('DEL', ARGV[2] .. d)
  end
end
if #due > 0 then redis.call('ZREM', KEYS[1], unpack(due)) end
return #due
"""

FORGET = """
-- Consumers that hold nothing leave a stream's group (XREADGROUP makes every worker process
-- a consumer for good: stopped and dead ones would pile up). Each is checked and deleted at
-- once: one that took an entry meanwhile stays, and no pending entry loses its owner.
-- KEYS: the stream; ARGV: the group, then the consumers. Returns how many left.
local n = 0
for i = 2, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[i]) == 0 then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[i])
    n = n + 1
  end
end
return n
"""

QUOTA = """
-- A tenant's call asks to start: all its requests, or none of them (a refused call leaves no
-- trace but its count). Producers run it before SUBMIT, for tenants with a quota.
-- KEYS: the tenant's use (counters), its leases and its token bucket: the keys it writes,
--       which a tenant's ACL user may write (EVAL needs write access to every key it
--       declares); the bucket is a sorted set (members tokens and ms) so that producers need
--       no HSET, which would let them write the model's metadata
-- ARGV: the tenant's quota key (limits, set by the operator; read here, in the same slot
--       through the tenant's hash tag), lease ms (a lease never released, its producer dead,
--       ends then), the call's prompt tokens, whether a refusal is counted here ('1'; '0':
--       the caller waits for room and asks again, and counts the refusal itself if it gives
--       up, so that a wait's tries do not count as refused requests), then one lease id per
--       request
-- Limits: in_flight (leases alive at once) and tokens_per_s (a bucket holding one second's
-- tokens, so bursts stay within a second's worth; a call larger than that runs once the bucket
-- is full and leaves it in debt). 0 or absent: no limit.
-- Returns {code, retry ms}: 0 admitted (leases added), 1 over the in-flight limit, 2 over the
-- tokens per second, 3 no quota set for this tenant (nothing recorded), 4 the call alone has
-- more requests than the in-flight limit (it can never run).
local limits = redis.call('HMGET', ARGV[1], 'in_flight', 'tokens_per_s')
local most, rate = tonumber(limits[1]) or 0, tonumber(limits[2]) or 0
if most <= 0 and rate <= 0 then return {3, 0} end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local lease_ms, cost, n = tonumber(ARGV[2]), tonumber(ARGV[3]), #ARGV - 4
local function refuse(code, retry)
  if ARGV[4] == '1' then redis.call('HINCRBY', KEYS[1], 'refused', n) end
  return {code, retry}
end
if most > 0 and n > most then return refuse(4, 0) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if most > 0 and redis.call('ZCARD', KEYS[2]) + n > most then return refuse(1, 0) end
if rate > 0 then
  local bucket = redis.call('ZMSCORE', KEYS[3], 'tokens', 'ms')
  local have, at = tonumber(bucket[1]) or rate, tonumber(bucket[2]) or now
  have = math.min(rate, have + rate * math.max(now - at, 0) / 1000)
  local need = math.min(cost, rate)
  if have < need then return refuse(2, math.ceil((need - have) * 1000 / rate)) end
  redis.call('ZADD', KEYS[3], have - cost, 'tokens', now, 'ms')
  -- kept until full again (a minute at least): a bucket in debt keeps its debt till repaid
  local full_ms = math.ceil((rate - (have - cost)) * 1000 / rate)
  redis.call('PEXPIRE', KEYS[3], math.max(60000, full_ms))
end
-- leases also under a token limit alone: the requests in flight are shown all the same
for i = 5, #ARGV do redis.call('ZADD', KEYS[2], now + lease_ms, ARGV[i]) end
if redis.call('PTTL', KEYS[2]) < lease_ms then
  redis.call('PEXPIRE', KEYS[2], lease_ms)  -- gone once the last lease has ended
end
redis.call('HINCRBY', KEYS[1], 'admitted', n)
return {0, 0}
"""


def submit_call(
    keys: Keys,
    model: str,
    shard: int,
    stream: str,
    requests: Sequence[tuple[str, str, bytes]],
    *,
    reply: str,
    wait_ms: int,
    max_queue: int,
    stale_ms: int,
    marker: bytes = b"",
    tenant: str = "",
) -> tuple[list[str], list[Any]]:
    """SUBMIT's KEYS and ARGV for ``requests`` (digest, force, message) of one shard; force is
    ``"0"``, ``"1"`` or an entry id (see the script)."""
    args: list[Any] = [*keys.digest_prefixes(model, shard), reply, wait_ms, max_queue]
    args += [marker, tenant, GROUP, stale_ms]
    for digest, force, message in requests:
        args += [digest, force, message]
    names = [keys.stats(model, shard), stream, keys.due(model, shard), keys.tenants(model, shard)]
    return names, args


def finish_call(
    keys: Keys,
    model: str,
    shard: int,
    push: bool,
    ttl_ms: int,
    answers: Sequence[tuple[str, bytes]],
) -> tuple[list[str], list[Any]]:
    """FINISH's KEYS and ARGV for ``answers`` (digest, reply) of one shard."""
    _, wait = keys.digest_prefixes(model, shard)
    args: list[Any] = ["1" if push else "0", ttl_ms, wait]
    for digest, reply in answers:
        args += [digest, reply]
    return [keys.stats(model, shard), keys.due(model, shard)], args


class Script:
    """A Lua script called by SHA; ``run`` loads it (once) when Redis does not know it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Any]) -> None:
        # execute_command: redis-py's cluster pipeline refuses its evalsha method (it routes
        # EVALSHA by its first key all the same)
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    def eval_command(self, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
        """An EVAL with the source: never NOSCRIPT, for a pipeline whose later commands must
        not run after a failed call (Redis hashes the 2 KB source each time: microseconds)."""
        return ["EVAL", self.source, len(keys), *keys, *args]

    async def load(self, redis: Any) -> None:
        await load_script(redis, self.source)

    def load_sync(self, redis: Any) -> None:
        load_script_sync(redis, self.source)


@contextmanager
def moving_slots() -> Iterator[None]:
    """Redis' refusal of a script's key in a slot moving between nodes ("non local key"), raised
    inside, comes out as the transient :func:`shared.redis_conn.moving_slot` makes of it."""
    try:
        yield
    except ResponseError as e:
        again = moving_slot(e)
        if again is e:
            raise
        raise again from e


async def execute(
    redis: Any,
    build: Callable[[Any], None],
    scripts: Sequence[Script],
    raise_on_error: bool = True,
    seen: Callable[[list[Any]], None] | None = None,
) -> list[Any]:
    """Build and run a non-transactional pipeline; on NOSCRIPT load ``scripts`` and run it again.

    Every command lmpool pipelines is safe to repeat, so a second run after a partial first one
    changes nothing but the missing parts. ``seen`` gets each run's results (errors in place
    unless ``raise_on_error``), also the first run's of a pipeline run twice: what a command
    that ran returned (the waiter sets a FINISH took) is not lost with it.
    """
    for attempt in (1, 2):
        pipe = redis.pipeline(transaction=False)
        build(pipe)
        try:
            with moving_slots():
                results: list[Any] = await pipe.execute(raise_on_error=raise_on_error)
        except NoScriptError:
            if attempt == 2:
                raise
            results = [NoScriptError()]
        if seen is not None:
            seen(results)
        if attempt == 1 and any(isinstance(r, NoScriptError) for r in results):
            for script in scripts:
                await script.load(redis)
            continue
        return [moving_slot(r) for r in results]
    raise AssertionError("unreachable")


async def execute_resp(
    conn: RespConnection, build: Callable[[Any], None], scripts: Sequence[Script], timeout_s: float
) -> list[Any]:
    """:func:`execute` on a :class:`shared.resp.RespConnection` (``build`` gets the pipeline
    methods of ``shared.resp.Commands``); the first error reply is raised."""
    for attempt in (1, 2):
        commands = Commands()
        build(commands)
        results = await conn.execute(commands.commands, timeout_s)
        errors = [r for r in results if isinstance(r, ResponseError)]
        if attempt == 1 and any(str(e).startswith("NOSCRIPT") for e in errors):
            loaded = await conn.execute([["SCRIPT", "LOAD", s.source] for s in scripts], timeout_s)
            errors = [r for r in loaded if isinstance(r, ResponseError)]
            if not errors:
                continue
        if errors:
            raise errors[0]
        return results
    raise AssertionError("unreachable")


async def call_resp(
    conn: RespConnection,
    script: Script,
    calls: Sequence[tuple[Sequence[str], Sequence[Any]]],
    timeout_s: float,
) -> list[Any]:
    """``script`` once for each ``(keys, args)`` of ``calls``, in one pipeline on ``conn``
    (packed by ``shared.resp``, several times cheaper than redis-py's packing of a SUBMIT's
    arguments); one answer each, an error reply in its place. The calls that met NOSCRIPT run
    again once the script is loaded."""
    commands = [["EVALSHA", script.sha, len(keys), *keys, *args] for keys, args in calls]
    answers = await conn.execute(commands, timeout_s)
    missing = [i for i, a in enumerate(answers) if _noscript(a)]
    if missing:
        (loaded,) = await conn.execute([["SCRIPT", "LOAD", script.source]], timeout_s)
        if isinstance(loaded, ResponseError):
            raise loaded
        again = await conn.execute([commands[i] for i in missing], timeout_s)
        for i, answer in zip(missing, again, strict=True):
            answers[i] = answer
    return answers


def _noscript(answer: Any) -> bool:
    return isinstance(answer, ResponseError) and str(answer).startswith("NOSCRIPT")


async def run_script(redis: Any, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """One script call outside a pipeline (cheaper for a single command); loads it on
    NOSCRIPT."""
    with moving_slots():
        try:
            return await redis.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await script.load(redis)
            return await redis.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)


SUBMIT_SCRIPT = Script(SUBMIT)
FINISH_SCRIPT = Script(FINISH)
SWEEP_SCRIPT = Script(SWEEP)
QUOTA_SCRIPT = Script(QUOTA)
FORGET_SCRIPT = Script(FORGET)
