-- ARGV[4] holder. Returns 1 when the holder held an unexpired lease, else 0.
local before = admissible()
prune()
local removed = redis.call('ZREM', holders, ARGV[4])
redis.call('HDEL', hinfo, ARGV[4])
if removed == 1 then touch(holders, hinfo) end
wake(before)
return removed
