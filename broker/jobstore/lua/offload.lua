-- The final trajectory of an ended job is in the results store at ARGV[1] (after lib.lua):
-- Redis keeps only the job's record (its stub), pointing there, and drops the trajectory's
-- keys. A job already delivered keeps its record only ARGV[3] seconds more (see settle_stub).
-- KEYS: 1 job hash, 2 trajectory head, 3 turns list, 4 turn digests
-- ARGV: 1 location, 2 terminal statuses (comma-separated), 3 seconds a delivered record lives
-- Returns 1, or 0 (no such job, not ended, or offloaded already: the first location stays).
local h = redis.call('HMGET', KEYS[1], 'status', 'result')
if not h[1] then return 0 end
if not string.find(',' .. ARGV[2] .. ',', ',' .. h[1] .. ',', 1, true) then return 0 end
if nonempty(h[2]) then return 0 end
redis.call('HSET', KEYS[1], 'result', ARGV[1])
redis.call('HDEL', KEYS[1], 'context')
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
settle_stub(KEYS[1], ARGV[2], tonumber(ARGV[3]))
return 1
