-- The gateway's first draw of a new dynamic batch (after lib.lua).
-- KEYS: none (keys are computed from the prefix)
-- ARGV: 1 key prefix, 2 batch id, 3 now
-- Returns the ids of the jobs drawn.
return draw(ARGV[1], ARGV[2], ARGV[3])
