-- A worker has received a stage message (reserved it: it may wait before a pool process
-- begins it). Note who holds it, so the stage is taken over if that worker dies first; a
-- sweeper's pending mark for the same task gives way to it.
-- KEYS: 1 job hash, 2 held stages (sorted set), 3 jobs in transit (sorted set)
-- ARGV: 1 task id, 2 owner (the worker's heartbeat id), 3 now,
--       4 terminal statuses (comma-separated), 5 the attempt the message belongs to
-- Returns -1 (no such job), 0 (ended), 2 (the message is of an earlier attempt) or 1.
local h = redis.call('HMGET', KEYS[1], 'status', 'attempt', 'job_id', 'active', 'active_pending')
if not h[1] then return -1 end
if string.find(',' .. ARGV[4] .. ',', ',' .. h[1] .. ',', 1, true) then return 0 end
if tonumber(h[2] or '0') > tonumber(ARGV[5]) then return 2 end
redis.call('HSET', KEYS[1], 'reserved', ARGV[1], 'reserved_owner', ARGV[2],
           'reserved_since', ARGV[3])
if h[5] == '1' and h[4] == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'active', 'active_at', 'active_owner', 'active_since',
             'active_pending')
end
redis.call('ZADD', KEYS[2], ARGV[3], h[3])
redis.call('ZREM', KEYS[3], h[3])
return 1
