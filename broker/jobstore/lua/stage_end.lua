-- Clear the stage mark (if it is this task's, and drop it from the held stages) and confirm a
-- cancelled job stopped (after lib.lua). A live job whose stage mark this clears waits for
-- the message of its next stage: it is indexed in transit (by now) until a worker notes it.
-- KEYS: 1 job hash
-- ARGV: 1 key prefix, 2 task id ('' for none), 3 now, 4 '1' to mark the sandbox released,
--       5 terminal statuses (comma-separated), 6 seconds a delivered record lives once the
--       job holds nothing (see settle_stub)
-- Returns 'done' if that made a cancelling batch done, else ''.
if redis.call('EXISTS', KEYS[1]) == 0 then return '' end
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'sandbox_released', '1') end
local active = redis.call('HGET', KEYS[1], 'active')
if ARGV[2] ~= '' and active == ARGV[2] then
  redis.call('HDEL', KEYS[1], 'active', 'active_at', 'active_owner', 'active_since',
             'active_pending')
  local h = redis.call('HMGET', KEYS[1], 'job_id', 'status')
  redis.call('ZREM', ARGV[1] .. 'held', h[1])
  if not string.find(',' .. ARGV[5] .. ',', ',' .. h[2] .. ',', 1, true) then
    redis.call('ZADD', ARGV[1] .. 'transit', ARGV[3], h[1])
  end
end
settle_stub(KEYS[1], ARGV[5], tonumber(ARGV[6]))
return ack(ARGV[1], KEYS[1], ARGV[3])
