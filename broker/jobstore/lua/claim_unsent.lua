-- Claim the unsent jobs older than the cutoff (their sender is presumed gone) by moving them
-- to now.
-- KEYS: 1 unsent zset
-- ARGV: 1 cutoff, 2 now
-- Returns the claimed job ids.
local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, jid in ipairs(stale) do redis.call('ZADD', KEYS[1], ARGV[2], jid) end
return stale
