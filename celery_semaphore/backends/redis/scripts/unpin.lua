-- Release the pin resize.lua set: the newest declaration's limit (dl) is in force again, an
-- adaptive limit's learned value (floor(ac)) (the limit stays when nobody declared one).
-- Returns the limit in force, -1 when the semaphore is unknown. Growing wakes the waiters that
-- now fit.
local before = P.begin()
local cfg = redis.call('HMGET', config, 'limit', 'dl', 'ds', 'ac', 'ku')
if not cfg[1] then return -1 end
local limit = tonumber(cfg[2]) or tonumber(cfg[1])
if cfg[4] then limit = math.floor(tonumber(cfg[4])) end
redis.call('HDEL', config, 'pinned')
redis.call('HSET', config, 'limit', limit)
if not cfg[3] then redis.call('HSET', config, 'ds', 0) end  -- no longer of the old format
P.keep(nil, cfg[5])
P.wake(before)
return limit
