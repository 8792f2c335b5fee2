-- ARGV[4] holder. Returns 1 when the holder held an unexpired lease, else 0.
local before = begin()
local removed = redis.call('ZREM', holders, ARGV[4])
if removed == 1 then
  local info = redis.call('HGET', hinfo, ARGV[4])
  redis.call('HDEL', hinfo, ARGV[4])
  if info and redis.call('EXISTS', config) == 1 then
    observe('hold', now - tonumber(string.match(info, '^%d+\n%d+\n(%d+)')))
    if cost_in(info) > 1 then redis.call('HINCRBY', config, 'xh', 1 - cost_in(info)) end
  end
end
wake(before)
forget_if_empty()
return removed
