-- Read-only snapshot: {now, limit, declared..., holders [holder, expiry, info]...,
-- waiters [holder, ticket, info]...} or false when the semaphore is unknown.
local limit = redis.call('HGET', cfg, 'limit')
if not limit then return false end
local declared_list = {}
local seen = redis.call('HGETALL', declared)
for i = 1, #seen, 2 do
  if tonumber(seen[i + 1]) >= now - idle_ms * 1000 then
    table.insert(declared_list, seen[i]); table.insert(declared_list, seen[i + 1])
  end
end
local holder_list = {}
local live = redis.call('ZRANGEBYSCORE', holders, '(' .. int(now), '+inf', 'WITHSCORES')
for i = 1, #live, 2 do
  table.insert(holder_list, live[i]); table.insert(holder_list, live[i + 1])
  table.insert(holder_list, redis.call('HGET', hinfo, live[i]) or '')
end
local waiter_list = {}
local queued = redis.call('ZRANGE', queue, 0, -1, 'WITHSCORES')
for i = 1, #queued, 2 do
  local expiry = tonumber(redis.call('ZSCORE', wexp, queued[i]) or 0)
  if expiry > now then
    table.insert(waiter_list, queued[i]); table.insert(waiter_list, queued[i + 1])
    table.insert(waiter_list, redis.call('HGET', winfo, queued[i]) or '')
  end
end
return {int(now), limit, declared_list, holder_list, waiter_list}
