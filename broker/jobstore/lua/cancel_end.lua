-- A cancellation pass has ended (after lib.lua).
-- KEYS: none (keys are computed from the prefix)
-- ARGV: 1 key prefix, 2 batch id, 3 token, 4 now
-- Returns 'done' if that made the batch done, else ''.
redis.call('SREM', ARGV[1] .. 'batch:' .. ARGV[2] .. ':stopping', ARGV[3])
return settle(ARGV[1], ARGV[2], ARGV[4])
