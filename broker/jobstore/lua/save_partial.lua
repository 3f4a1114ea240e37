-- Store the trajectory so far, unless the job has ended.
-- KEYS: 1 job hash, 2 trajectory
-- ARGV: 1 trajectory json, 2 ttl, 3 terminal statuses (comma-separated)
-- Returns -1 (no such job), 0 (ended) or 1.
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
if string.find(',' .. ARGV[3] .. ',', ',' .. cur .. ',', 1, true) then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
return 1
