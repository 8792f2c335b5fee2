-- ARGV[4] seconds (us), [5] reason: close the semaphore until now + seconds unless the pause in
-- force ends later (pauses only extend; base.py, "Pauses"). A name with no state gets one
-- (limit 0, no declaration), kept at least until the pause ends. Returns the end of the pause
-- in force (us). Nobody is admitted or pushed a grant while it lasts.
local before = P.begin()
local c = redis.call('HMGET', config, 'pu', 'limit', 'ku', 'touched')
local finish = now + tonumber(ARGV[4])
local pu = tonumber(c[1]) or 0
local set = {}
if finish > pu then
  pu = finish
  set = {'pu', P.int(pu), 'pr', ARGV[5] or ''}
end
if not c[2] then  -- created by this pause: a caller's declaration gives it a limit
  for _, v in ipairs({'limit', 0, 'ds', 0}) do table.insert(set, v) end
end
local ku = math.max(tonumber(c[3]) or 0, pu)
if ku ~= tonumber(c[3]) then table.insert(set, 'ku') table.insert(set, P.int(ku)) end
if #set > 0 then redis.call('HSET', config, unpack(set)) end
P.keep(c[4], ku)
if ku - now > idle_ms * 1000 then  -- a pause beyond idle_ms: config outlives it
  redis.call('PEXPIRE', config, math.ceil((ku - now) / 1000) + 1000)
end
P.wake(before)
P.forget_if_empty()
return pu
