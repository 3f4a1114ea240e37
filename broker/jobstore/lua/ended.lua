-- Which of the jobs KEYS (their records) have ended: no record, or a final status.
-- ARGV[1]: the final statuses, comma-separated. Returns the 1-based positions of those in KEYS
-- (usually none: a watch of the jobs in flight reads them all and is sent back almost nothing).
local final = {}
for status in string.gmatch(ARGV[1], '[^,]+') do final[status] = true end
local ended = {}
for i, key in ipairs(KEYS) do
  local status = redis.call('HGET', key, 'status')
  if not status or final[status] then ended[#ended + 1] = i end
end
return ended
