-- ARGV[4] holder, [5] ttl (us). Returns the new expiry (us), or -1 when not held: an expired
-- lease is never brought back.
local before = admissible()
prune()
local result = -1
if redis.call('ZSCORE', holders, ARGV[4]) then
  result = now + tonumber(ARGV[5])
  redis.call('ZADD', holders, 'XX', int(result), ARGV[4])
  touch(holders)
end
wake(before)
return result
