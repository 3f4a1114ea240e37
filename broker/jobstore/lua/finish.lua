-- Record a job's end exactly once (after lib.lua).
-- The final trajectory is stored like a partial one (sync_turns: only the turns the store
-- lacks, and its head); the job store then moves it to the results store (offload.lua).
-- KEYS: 1 job hash, 2 trajectory head, 3 status counts hash, 4 done zset, 5 batch hash ('' for
--       none), 6 batch stream ('' for none), 7 group hash, 8 the job's wake-up list (waiters
--       block on it), 9 turns list, 10 turn digests
-- ARGV: 1 status, 2 now, 3 head json, 4 reward ('' if none), 5 ttl,
--       6 terminal statuses (comma-separated), 7 error json ('' for none), 8 key prefix,
--       9 digests of all turns, 10 index of the first turn sent, 11... the turns from there on
-- Returns {-1} (no such job), {0} (already ended), {2, c} (send the turns from c on; nothing
-- was written) or {1, event, new job ids...} (see group_done; event '' and no ids for a job
-- outside dynamic batches).
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return {-1} end
if string.find(',' .. ARGV[6] .. ',', ',' .. cur .. ',', 1, true) then return {0} end
local ttl = tonumber(ARGV[5])
local p, now = ARGV[8], ARGV[2]
local written = sync_turns(KEYS[2], KEYS[9], KEYS[10], ARGV[3], ARGV[9], tonumber(ARGV[10]),
                           ARGV, 11, ttl)
if written < 0 then return {2, -1 - written} end
redis.call('HINCRBY', KEYS[1], 'bytes_written', written)
local held = redis.call('HMGET', KEYS[1], 'active', 'sandbox', 'sandbox_released', 't_init',
                        'tenant')
redis.call('HSET', KEYS[1], 'status', ARGV[1], 't_end', now, 'error', ARGV[7])
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('HINCRBY', KEYS[3], cur, -1)
redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
local job_id = redis.call('HGET', KEYS[1], 'job_id')
if nonempty(held[5]) then redis.call('SREM', p .. 'tenant:' .. held[5] .. ':live', job_id) end
redis.call('ZADD', KEYS[4], now, job_id)
redis.call('ZREM', p .. 'transit', job_id)
redis.call('RPUSH', KEYS[8], ARGV[1])
redis.call('EXPIRE', KEYS[8], 600)
-- workers running a stage of the job stop it now, not at their next watch (listen_ended)
redis.call('PUBLISH', p .. 'ended', job_id)
local out = {1, ''}
if KEYS[5] ~= '' and redis.call('EXISTS', KEYS[5]) == 1 then
  local bid = redis.call('HGET', KEYS[5], 'batch_id')
  if ARGV[1] == 'cancelled' and
     (nonempty(held[1]) or (nonempty(held[2]) and held[3] ~= '1')) then
    -- a stage of it still runs, or its sandbox is up: done only once that has stopped
    redis.call('SADD', KEYS[5] .. ':stopping', job_id)
    keep(p, bid, KEYS[5] .. ':stopping')
  end
  redis.call('HINCRBY', KEYS[5], 'n_' .. ARGV[1], 1)
  redis.call('HINCRBY', KEYS[5], 'finished', 1)
  if ARGV[4] ~= '' then
    redis.call('HINCRBYFLOAT', KEYS[5], 'reward_sum', ARGV[4])
    redis.call('HINCRBY', KEYS[5], 'reward_n', 1)
  end
  redis.call('XADD', KEYS[6], '*', 'job_id', job_id)
  keep(p, bid, KEYS[6])
  local finished = redis.call('HINCRBY', KEYS[7], 'finished', 1)
  if redis.call('TTL', KEYS[7]) < ttl then redis.call('EXPIRE', KEYS[7], ttl) end
  if ARGV[4] ~= '' then redis.call('HSET', KEYS[7], 'r:' .. job_id, ARGV[4]) end
  local dynamic = redis.call('HGET', KEYS[5], 'dynamic') == '1'
  if dynamic then
    -- rollout-seconds: from the job's first stage to its end (0 if it never started)
    if nonempty(held[4]) then
      redis.call('HINCRBYFLOAT', KEYS[7], 'secs', math.max(0, tonumber(now) - tonumber(held[4])))
      redis.call('HINCRBY', KEYS[7], 'started', 1)
    end
    if ARGV[1] == 'cancelled' then
      redis.call('HINCRBY', KEYS[7], 'n_cancelled', 1)
    elseif ARGV[4] == '' then
      redis.call('HINCRBY', KEYS[7], 'n_unrewarded', 1)
    else
      local r = tonumber(ARGV[4])
      local lo = redis.call('HGET', KEYS[7], 'rmin')
      local hi = redis.call('HGET', KEYS[7], 'rmax')
      if not lo or r < tonumber(lo) then redis.call('HSET', KEYS[7], 'rmin', ARGV[4]) end
      if not hi or r > tonumber(hi) then redis.call('HSET', KEYS[7], 'rmax', ARGV[4]) end
    end
  end
  if finished == tonumber(redis.call('HGET', KEYS[7], 'size')) then
    redis.call('HINCRBY', KEYS[5], 'groups_finished', 1)
    if dynamic then
      out = group_done(p, bid, redis.call('HGET', KEYS[1], 'group_id'), now)
    end
  end
end
return out
