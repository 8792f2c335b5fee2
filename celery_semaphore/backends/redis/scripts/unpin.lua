-- Release the pin resize.lua set: the newest declaration's limit (dl) is in force again (the
-- limit stays when nobody declared one). Returns the limit in force, -1 when the semaphore is
-- unknown. Growing wakes the waiters that now fit.
local before = begin()
local cfg = redis.call('HMGET', config, 'limit', 'dl', 'ds')
if not cfg[1] then return -1 end
local limit = tonumber(cfg[2]) or tonumber(cfg[1])
redis.call('HDEL', config, 'pinned')
redis.call('HSET', config, 'limit', limit)
if not cfg[3] then redis.call('HSET', config, 'ds', 0) end  -- no longer of the old format
keep(nil)
wake(before)
return limit
