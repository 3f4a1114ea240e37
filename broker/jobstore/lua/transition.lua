-- Move a live job to a new status, noting the host that runs the stage.
-- KEYS: 1 job hash, 2 status counts hash
-- ARGV: 1 new status, 2 now, 3 terminal statuses (comma-separated), 4 host ('' for none)
-- Returns -1 (no such job), 0 (ended, or already in that status) or 1.
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
if string.find(',' .. ARGV[3] .. ',', ',' .. cur .. ',', 1, true) then return 0 end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'host_' .. ARGV[1], ARGV[4]) end
if cur == ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1])
redis.call('HSETNX', KEYS[1], 't_' .. ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], cur, -1)
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
return 1
