-- A cancellation pass joins the batch (after lib.lua): a dynamic batch stops drawing (state
-- cancelling) and is not done before the pass ends (its token leaves the stopping set).
-- KEYS: none (keys are computed from the prefix)
-- ARGV: 1 key prefix, 2 batch id, 3 token, 4 now
-- Returns -1 (no such batch), 0 (the batch is over already) or 1.
local bkey = ARGV[1] .. 'batch:' .. ARGV[2]
if redis.call('EXISTS', bkey) == 0 then return -1 end
local state = redis.call('HGET', bkey, 'state')
if state == 'done' then return 0 end
if state == 'running' or state == 'draining' then
  redis.call('HSET', bkey, 'state', 'cancelling')
  redis.call('HSETNX', bkey, 't_cancel', ARGV[4])
end
redis.call('SADD', bkey .. ':stopping', ARGV[3])
keep(ARGV[1], ARGV[2], bkey .. ':stopping')
return 1
