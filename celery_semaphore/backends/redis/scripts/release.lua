-- ARGV[4] holder. Returns 1 when the holder held an unexpired lease, else 0.
local before = begin()
local removed = redis.call('ZREM', holders, ARGV[4])
if removed == 1 then redis.call('HDEL', hinfo, ARGV[4]) end
wake(before)
return removed
