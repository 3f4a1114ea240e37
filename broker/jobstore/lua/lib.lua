-- Helpers of the batch bookkeeping. The store prepends this file to the scripts that use them
-- (draw, finish, stage_end, cancel_begin, cancel_end); it reads no KEYS or ARGV of its own.
-- `p` is the key prefix, `bid` a batch id, `now` the caller's clock (seconds, as text).
local function nonempty(v) return v ~= nil and v ~= false and v ~= '' end

-- Give `key` the batch's remaining time to live.
local function keep(p, bid, key)
  local t = redis.call('TTL', p .. 'batch:' .. bid)
  if t > 0 then redis.call('EXPIRE', key, t) end
end

-- A cancelling batch whose stopping set has emptied is done; returns 'done' if it became so.
local function settle(p, bid, now)
  local bkey = p .. 'batch:' .. bid
  if redis.call('SCARD', bkey .. ':stopping') > 0 then return '' end
  if redis.call('HGET', bkey, 'state') ~= 'cancelling' then return '' end
  redis.call('HSET', bkey, 'state', 'done', 't_done', now)
  redis.call('XADD', bkey .. ':accepted', '*', 'end', '1')
  keep(p, bid, bkey .. ':accepted')
  return 'done'
end

-- A cancelled job is confirmed stopped once no stage of it runs and its sandbox is released.
local function ack(p, jkey, now)
  local h = redis.call('HMGET', jkey, 'job_id', 'batch_id', 'active', 'sandbox',
                       'sandbox_released')
  if not nonempty(h[2]) then return '' end
  local skey = p .. 'batch:' .. h[2] .. ':stopping'
  if redis.call('SISMEMBER', skey, h[1]) == 0 then return '' end
  if nonempty(h[3]) then return '' end
  if nonempty(h[4]) and h[5] ~= '1' then return '' end
  redis.call('SREM', skey, h[1])
  return settle(p, h[2], now)
end

-- Draw groups from the pool while fewer than `inflight_max` are in flight, creating their
-- jobs (status queued); returns the new job ids.
local function draw(p, bid, now)
  local bkey = p .. 'batch:' .. bid
  local b = redis.call('HMGET', bkey, 'state', 'inflight_max', 'group_size', 'tenant')
  local out = {}
  if b[1] ~= 'running' then return out end
  local tenant = b[4] or ''
  local live = p .. 'tenant:' .. tenant .. ':live'
  local cap, size = tonumber(b[2]), tonumber(b[3])
  local ttl = redis.call('TTL', bkey)
  while tonumber(redis.call('HGET', bkey, 'groups_inflight')) < cap do
    local idx = redis.call('LPOP', bkey .. ':draws')
    if not idx then break end
    local attempt = redis.call('HINCRBY', bkey .. ':attempts', idx, 1)
    local gid = bid .. '-' .. redis.call('HINCRBY', bkey, 'groups_seq', 1)
    -- spec[1] is a placeholder: the task itself stays in the spec hash (one copy per pool
    -- task, however many jobs sample it); jobs refer to it by key and field.
    local spec = redis.call('HMGET', bkey .. ':spec', 'ds:' .. idx, 'ds:' .. idx,
                            'iid:' .. idx, 'sampling:' .. (attempt - 1), 'agent')
    local ids = {}
    for i = 0, size - 1 do
      local jid = gid .. '-' .. i
      local jkey = p .. 'job:' .. jid
      local tids = '{"init": "' .. jid .. '-init", "run": "' .. jid .. '-run", "eval": "'
                   .. jid .. '-eval"}'
      redis.call('HSET', jkey, 'job_id', jid, 'status', 'queued',
                 'task_key', bkey .. ':spec', 'task_field', 'task:' .. idx, 'tenant', tenant,
                 'data_source', spec[2], 'instance_id', spec[3], 'group_id', gid,
                 'sample_index', i, 'batch_id', bid, 'sampling', spec[4], 'agent', spec[5],
                 'task_ids', tids, 'created_at', now, 't_queued', now)
      if ttl > 0 then redis.call('EXPIRE', jkey, ttl) end
      redis.call('ZADD', bkey .. ':unsent', now, jid)
      redis.call('ZADD', p .. 'transit', now, jid)
      ids[#ids + 1] = jid
      out[#out + 1] = jid
    end
    redis.call('RPUSH', bkey .. ':jobs', unpack(ids))
    keep(p, bid, bkey .. ':jobs')
    if tenant ~= '' then
      redis.call('SADD', live, unpack(ids))
      if ttl > 0 then redis.call('EXPIRE', live, ttl) end
    end
    keep(p, bid, bkey .. ':attempts')
    local gkey = p .. 'group:' .. gid
    redis.call('HSET', gkey, 'size', size, 'finished', 0, 'task', idx, 'attempt', attempt,
               'jobs', table.concat(ids, ' '))
    if ttl > 0 then redis.call('EXPIRE', gkey, ttl) end
    redis.call('HINCRBY', p .. 'counts', 'queued', size)
    redis.call('HINCRBY', bkey, 'total', size)
    redis.call('HINCRBY', bkey, 'groups_total', 1)
    redis.call('HINCRBY', bkey, 'groups_drawn', 1)
    redis.call('HINCRBY', bkey, 'groups_inflight', 1)
  end
  keep(p, bid, bkey .. ':unsent')
  return out
end

-- The last job of a dynamic group has ended: judge the group, refill, detect the target.
-- Returns {1, event, new job ids...}; event is 'target' (the caller cancels the rest),
-- 'done' (the batch ended without needing a cancellation) or ''.
local function group_done(p, bid, gid, now)
  local bkey = p .. 'batch:' .. bid
  local gkey = p .. 'group:' .. gid
  local b = redis.call('HMGET', bkey, 'state', 'target', 'early_cancel', 'attempts_max')
  local state = b[1]
  local g = redis.call('HMGET', gkey, 'n_cancelled', 'n_unrewarded', 'rmin', 'rmax', 'secs',
                       'started', 'task', 'jobs')
  local verdict
  if tonumber(g[1] or '0') > 0 then verdict = 'cancelled'
  elseif state ~= 'running' then verdict = 'surplus'
  elseif tonumber(g[2] or '0') > 0 then verdict = 'failed'
  elseif tonumber(g[3]) == tonumber(g[4]) then verdict = 'filtered'
  else verdict = 'accepted' end
  redis.call('HSET', gkey, 'verdict', verdict)
  redis.call('HINCRBY', bkey, 'groups_inflight', -1)
  local count = redis.call('HINCRBY', bkey, 'groups_' .. verdict, 1)
  local secs, started = g[5] or '0', g[6] or '0'
  local out = {1, ''}
  if verdict == 'accepted' then
    redis.call('HINCRBYFLOAT', bkey, 'seconds_used', secs)
    redis.call('HINCRBY', bkey, 'rollouts_used', started)
    redis.call('RPUSH', bkey .. ':groups', gid)
    keep(p, bid, bkey .. ':groups')
    for jid in string.gmatch(g[8], '%S+') do
      redis.call('XADD', bkey .. ':accepted', '*', 'job_id', jid)
    end
    keep(p, bid, bkey .. ':accepted')
    if count >= tonumber(b[2]) then
      redis.call('HSET', bkey, 't_target', now)
      if b[3] == '1' then
        state = 'cancelling'
        redis.call('SADD', bkey .. ':stopping', '~target')
        keep(p, bid, bkey .. ':stopping')
        out[2] = 'target'
      else
        state = 'draining'
      end
      redis.call('HSET', bkey, 'state', state)
    end
  elseif verdict == 'filtered' or verdict == 'failed' then
    redis.call('HINCRBYFLOAT', bkey, 'seconds_filtered', secs)
    redis.call('HINCRBY', bkey, 'rollouts_filtered', started)
  else
    redis.call('HINCRBYFLOAT', bkey, 'seconds_wasted', secs)
    redis.call('HINCRBY', bkey, 'rollouts_wasted', started)
  end
  if state == 'running' and verdict ~= 'accepted' then
    local tried = redis.call('HGET', bkey .. ':attempts', g[7])
    if tonumber(tried or '0') < tonumber(b[4]) then
      redis.call('RPUSH', bkey .. ':draws', g[7])
    end
  end
  if state == 'running' then
    for _, jid in ipairs(draw(p, bid, now)) do out[#out + 1] = jid end
  end
  if (state == 'running' or state == 'draining')
     and tonumber(redis.call('HGET', bkey, 'groups_inflight')) == 0 then
    redis.call('HSET', bkey, 'state', 'done', 't_done', now)
    redis.call('XADD', bkey .. ':accepted', '*', 'end', '1')
    keep(p, bid, bkey .. ':accepted')
    out[2] = 'done'
  end
  return out
end

-- The stored turns of a job brought level with the caller's (save_partial, finish). `hkey` is
-- the trajectory's head (its small fields as JSON), `lkey` the list of its turns (one JSON
-- each), `skey` their digests (8 bytes per turn, in order). The caller sends the digests of
-- all its turns (`sums`) but the entries only of its turns from index `from` on, as
-- argv[first], argv[first + 1], ... Stored turns whose digest matches the caller's at the same
-- place stay; the rest are cut and the caller's later turns appended, so a turn is written
-- once, and again only if it changed or the episode started over. The head is written when
-- it changed. Returns -1 - c when the caller
-- must send its entries from turn c on (it sent too few; nothing was written), else the
-- number of bytes written.
local SUM = 8
local function sync_turns(hkey, lkey, skey, head, sums, from, argv, first, ttl)
  local old = redis.call('GET', skey) or ''
  local n_old, n_new = math.floor(#old / SUM), math.floor(#sums / SUM)
  local c, limit = 0, math.min(n_old, n_new)
  while c < limit and
        string.sub(old, c * SUM + 1, (c + 1) * SUM) == string.sub(sums, c * SUM + 1, (c + 1) * SUM) do
    c = c + 1
  end
  if c < from then return -1 - c end
  local written = 0
  if n_old > c then
    if c == 0 then redis.call('DEL', lkey) else redis.call('LTRIM', lkey, 0, c - 1) end
  end
  for i = c, n_new - 1 do
    local entry = argv[first + i - from]
    redis.call('RPUSH', lkey, entry)
    written = written + #entry
  end
  if n_new == 0 then
    redis.call('DEL', skey)
  elseif n_new < n_old then
    redis.call('SET', skey, sums)
    written = written + #sums
  elseif c < n_new then
    redis.call('SETRANGE', skey, c * SUM, string.sub(sums, c * SUM + 1))
    written = written + (n_new - c) * SUM
  end
  if redis.call('GET', hkey) ~= head then
    redis.call('SET', hkey, head)
    written = written + #head
  end
  for _, key in ipairs({hkey, lkey, skey}) do redis.call('EXPIRE', key, ttl) end
  return written
end

-- A delivered job that has ended, whose trajectory is in the results store and that holds
-- nothing any more (no stage of it runs, its sandbox is released: what frees them reads the
-- record) keeps its record only `ttl` seconds more. Called when any of these becomes true.
local function settle_stub(jkey, terminal, ttl)
  local h = redis.call('HMGET', jkey, 'status', 'result', 'delivered', 'active', 'sandbox',
                       'sandbox_released')
  if not h[1] or h[3] ~= '1' or not nonempty(h[2]) then return end
  if not string.find(',' .. terminal .. ',', ',' .. h[1] .. ',', 1, true) then return end
  if nonempty(h[4]) or (nonempty(h[5]) and h[6] ~= '1') then return end
  local t = redis.call('TTL', jkey)
  if t < 0 or t > ttl then redis.call('EXPIRE', jkey, ttl) end
end
