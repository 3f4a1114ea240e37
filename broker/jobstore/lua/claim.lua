-- Take over, once, the stage of a job whose holder stopped (its worker's heartbeat, or for a
-- pinned job its node's, is gone): count a new attempt and mark the stage that is sent again
-- as held, pending, by the sweeper that took it, so that a sweeper dying before it sends the
-- stage leaves the job to the next sweep instead of stranding it.
-- KEYS: 1 job hash, 2 held stages (sorted set), 3 the heartbeat that must be gone,
--       4 the job's pinned set on its node ('' for none), 5 jobs in transit (sorted set)
-- ARGV: 1 terminal statuses (comma-separated), 2 the mark's task id as seen ('' for none, or
--       for a stage only reserved by a worker that died before beginning it),
--       3 the attempt as seen, 4 the task id of the stage to send, 5 where the sweeper runs
--       (host|pid|start time), 6 the sweeper's owner id, 7 now, 8 '1' to restart from INIT
--       (the record forgets its sandbox and context, and the job leaves its pinned set)
-- Returns the job's new attempt, or 0 (not taken: the job ended, its mark or attempt changed
-- since it was seen, or the heartbeat is back).
local h = redis.call('HMGET', KEYS[1], 'status', 'active', 'attempt', 'job_id')
if not h[1] then return 0 end
if string.find(',' .. ARGV[1] .. ',', ',' .. h[1] .. ',', 1, true) then return 0 end
if (h[2] or '') ~= ARGV[2] then return 0 end
if tonumber(h[3] or '0') ~= tonumber(ARGV[3]) then return 0 end
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HSET', KEYS[1], 'active', ARGV[4], 'active_at', ARGV[5], 'active_owner', ARGV[6],
           'active_since', ARGV[7], 'active_pending', '1')
redis.call('HDEL', KEYS[1], 'reserved', 'reserved_owner', 'reserved_since')
redis.call('ZADD', KEYS[2], ARGV[7], h[4])
redis.call('ZREM', KEYS[5], h[4])
if ARGV[8] == '1' then
  redis.call('HDEL', KEYS[1], 'sandbox', 'sandbox_released', 'context')
  if KEYS[4] ~= '' then redis.call('SREM', KEYS[4], h[4]) end
end
return attempt
