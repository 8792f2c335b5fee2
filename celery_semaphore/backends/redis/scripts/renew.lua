-- ARGV[4] holder, [5] ttl (us). Returns the new expiry (us), or -1 when not held: an expired
-- or released lease is never brought back (pruning runs first).
local before = P.begin()
local result = -1
if redis.call('ZSCORE', holders, ARGV[4]) then
  result = now + tonumber(ARGV[5])
  redis.call('ZADD', holders, 'XX', P.int(result), ARGV[4])
  P.holders_changed()
  local c = redis.call('HMGET', config, 'touched', 'ku')
  P.keep(c[1], c[2])
elseif redis.call('EXISTS', config) == 1 then
  P.stat('lost', 1)  -- a renewal that finds its lease gone
end
P.wake(before)
return result
