"""Lua scripts that make the request path atomic (keys come from ``shared.keys``).

SUBMIT (producer) and FINISH (worker) together guarantee that a waiting producer is answered
exactly when its result exists: either SUBMIT finds the result, or FINISH finds the producer
among the digest's waiters. A digest is queued once however many producers ask for it.
"""

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
-- KEYS: result, waiters, inflight
-- ARGV: result (empty for an error), reply, result ttl ms, reply ttl ms
if ARGV[1] ~= '' then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3]) end
local ws = redis.call('SMEMBERS', KEYS[2])
for _, w in ipairs(ws) do
  redis.call('RPUSH', w, ARGV[2])
  redis.call('PEXPIRE', w, ARGV[4])
end
redis.call('DEL', KEYS[2], KEYS[3])
return #ws
"""
