-- Store the trajectory so far, unless the job has ended (after lib.lua): only the turns the
-- store lacks, and the head if it changed (see sync_turns).
-- KEYS: 1 job hash, 2 trajectory head, 3 turns list, 4 turn digests
-- ARGV: 1 terminal statuses (comma-separated), 2 ttl, 3 head json, 4 digests of all turns,
--       5 index of the first turn sent, 6... the turns from there on (json each)
-- Returns {-1} (no such job), {0} (ended), {2, c} (send the turns from c on; nothing was
-- written) or {1, bytes written}.
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return {-1} end
if string.find(',' .. ARGV[1] .. ',', ',' .. cur .. ',', 1, true) then return {0} end
local written = sync_turns(KEYS[2], KEYS[3], KEYS[4], ARGV[3], ARGV[4], tonumber(ARGV[5]),
                           ARGV, 6, tonumber(ARGV[2]))
if written < 0 then return {2, -1 - written} end
redis.call('HINCRBY', KEYS[1], 'bytes_written', written)
return {1, written}
