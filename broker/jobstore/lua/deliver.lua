-- An ended job's trajectory was delivered (after lib.lua): its record keeps only ARGV[2]
-- seconds more once the trajectory is in the results store and the job holds nothing (see
-- settle_stub; offload.lua and stage_end.lua settle it when that comes later).
-- KEYS: 1 job hash
-- ARGV: 1 terminal statuses (comma-separated), 2 seconds a delivered record lives
-- Returns 1, or 0 (no such job, or not ended).
local h = redis.call('HMGET', KEYS[1], 'status', 'delivered')
if not h[1] then return 0 end
if not string.find(',' .. ARGV[1] .. ',', ',' .. h[1] .. ',', 1, true) then return 0 end
if h[2] ~= '1' then redis.call('HSET', KEYS[1], 'delivered', '1') end
settle_stub(KEYS[1], ARGV[1], tonumber(ARGV[2]))
return 1
