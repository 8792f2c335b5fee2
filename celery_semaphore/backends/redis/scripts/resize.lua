-- ARGV[4] limit, pinned (no declaration changes it until unpin.lua). Returns 1 when the
-- semaphore was created by this call. Growing wakes the waiters that now fit; shrinking
-- admits nobody until holders drop below the new limit.
local before = P.begin()
local created = 1 - redis.call('EXISTS', config)
redis.call('HSET', config, 'limit', tonumber(ARGV[4]), 'pinned', '1')
if created == 1 then redis.call('HSET', config, 'ds', 0) end
P.prune_declared()
P.keep(nil, redis.call('HGET', config, 'ku'))
P.wake(before)
return created
