"""Lua scripts that make the request path atomic (keys come from ``shared.keys``).

SUBMIT (producer) and FINISH (worker) together guarantee that a waiting producer is answered
exactly when its result exists. The worker SETs the result, then runs FINISH, which takes the
digest's waiter set: a SUBMIT before the SET is in that set, one after it finds the result. A
digest is queued once however many producers ask for it.

The result itself never passes through Lua: moving a 200 KB value in and out of a script costs
Redis several times the CPU of a plain SET and RPUSH (``bench/reply_paths.py`` notes).
Scripts are called by SHA in pipelines (``Script.queue``) and loaded once, again on NOSCRIPT:
redis-py's own Script objects add a ``SCRIPT EXISTS`` round trip to every pipeline.
"""

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import NoScriptError

SUBMIT = """
-- KEYS: result, waiters, inflight, stream, stats
-- ARGV: reply list, message, waiter ttl ms, inflight ttl ms, max queue
local r = redis.call('GET', KEYS[1])
if r then
  redis.call('HINCRBY', KEYS[5], 'cache_hits', 1)
  return {1, r}
end
redis.call('SADD', KEYS[2], ARGV[1])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
if redis.call('SET', KEYS[3], '1', 'NX', 'PX', ARGV[4]) then
  if redis.call('XLEN', KEYS[4]) >= tonumber(ARGV[5]) then
    redis.call('DEL', KEYS[3])
    redis.call('SREM', KEYS[2], ARGV[1])
    redis.call('HINCRBY', KEYS[5], 'rejected', 1)
    return {2}
  end
  redis.call('XADD', KEYS[4], '*', 'm', ARGV[2])
  redis.call('HINCRBY', KEYS[5], 'queued', 1)
  return {0, 1}
end
redis.call('PEXPIRE', KEYS[3], ARGV[4], 'GT')
redis.call('HINCRBY', KEYS[5], 'joined', 1)
return {0, 0}
"""

FINISH = """
-- KEYS: waiters, inflight. Run after the result (if any) is SET. Returns the reply lists.
local ws = redis.call('SMEMBERS', KEYS[1])
redis.call('DEL', KEYS[1], KEYS[2])
return ws
"""


class Script:
    """A Lua script called by SHA; ``run`` loads it (once) when Redis does not know it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Any]) -> None:
        pipe.evalsha(self.sha, len(keys), *keys, *args)

    async def load(self, redis: Any) -> None:
        await redis.script_load(self.source)

    def load_sync(self, redis: Any) -> None:
        redis.script_load(self.source)


async def execute(
    redis: Any, build: Callable[[Any], None], scripts: Sequence[Script], raise_on_error: bool = True
) -> list[Any]:
    """Build and run a non-transactional pipeline; on NOSCRIPT load ``scripts`` and run it again.

    Every command lmpool pipelines is safe to repeat, so a second run after a partial first one
    changes nothing but the missing parts.
    """
    for attempt in (1, 2):
        pipe = redis.pipeline(transaction=False)
        build(pipe)
        try:
            results: list[Any] = await pipe.execute(raise_on_error=raise_on_error)
        except NoScriptError:
            results = [NoScriptError()]
        if attempt == 1 and any(isinstance(r, NoScriptError) for r in results):
            for script in scripts:
                await script.load(redis)
            continue
        return results
    raise AssertionError("unreachable")


SUBMIT_SCRIPT = Script(SUBMIT)
FINISH_SCRIPT = Script(FINISH)
