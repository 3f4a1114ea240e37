-- A stage may begin only while its job is live: mark it running.
-- KEYS: 1 job hash
-- ARGV: 1 task id, 2 where (host|pid|start time), 3 terminal statuses (comma-separated)
-- Returns -1 (no such job), 0 (ended) or 1.
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
if string.find(',' .. ARGV[3] .. ',', ',' .. cur .. ',', 1, true) then return 0 end
redis.call('HSET', KEYS[1], 'active', ARGV[1], 'active_at', ARGV[2])
return 1
