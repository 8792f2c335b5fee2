-- End the pause in force now (base.py, "Pauses"). Returns 1 when one was in force, else 0.
-- Wakes (or pushes grants to) the waiters that are admissible then.
local before = P.begin()
local pu = redis.call('HGET', config, 'pu')
if pu then redis.call('HDEL', config, 'pu', 'pr') end
P.wake(before)
if pu and tonumber(pu) > now then return 1 end
return 0
