-- A stage may begin only while its job is live, and only from the job's current attempt:
-- mark it running, by whom and since when (in place of its reservation), and index it among
-- the held stages.
-- KEYS: 1 job hash, 2 held stages (sorted set: job id by the time its stage began),
--       3 jobs in transit (sorted set)
-- ARGV: 1 task id, 2 where (host|pid|start time), 3 terminal statuses (comma-separated),
--       4 owner (the heartbeat id of the worker holding it, '' for none), 5 now,
--       6 the attempt the stage message belongs to ('' to skip the check)
-- Returns -1 (no such job), 0 (ended), 2 (the message is of an earlier attempt) or 1.
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
if string.find(',' .. ARGV[3] .. ',', ',' .. cur .. ',', 1, true) then return 0 end
if ARGV[6] ~= '' then
  local attempt = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0')
  if attempt > tonumber(ARGV[6]) then return 2 end
end
redis.call('HSET', KEYS[1], 'active', ARGV[1], 'active_at', ARGV[2], 'active_owner', ARGV[4],
           'active_since', ARGV[5])
redis.call('HDEL', KEYS[1], 'active_pending', 'reserved', 'reserved_owner', 'reserved_since')
local jid = redis.call('HGET', KEYS[1], 'job_id')
redis.call('ZADD', KEYS[2], ARGV[5], jid)
redis.call('ZREM', KEYS[3], jid)
return 1
