-- ARGV[4] holder, [5] declared limit, [6] ttl (us), [7] meta JSON, [8] wait (0/1),
-- [9] client id, [10] waiter ttl (us).
-- Returns {1, slot, epoch, expires, now, limit} or {0, position (-1: not queued),
-- retry_after (us, -1: no holder), now, limit}.
local holder, declared_limit, ttl = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local meta, wait, client, waiter_ttl = ARGV[7], ARGV[8] == '1', ARGV[9], tonumber(ARGV[10])

local before = admissible()
prune()
local limit = tonumber(redis.call('HGET', cfg, 'limit'))
if not limit then
  limit = declared_limit
  redis.call('HSET', cfg, 'limit', limit)
end
redis.call('HSET', declared, declared_limit, int(now))

local expires = redis.call('ZSCORE', holders, holder)
if expires then
  local slot, epoch = string.match(redis.call('HGET', hinfo, holder), '^(%d+)\n(%d+)\n')
  touch(declared)
  wake(before)
  return {1, tonumber(slot), tonumber(epoch), tonumber(expires), now, limit}
end

local count = redis.call('ZCARD', holders)
local queued = redis.call('ZRANK', queue, holder)
local rank = queued or redis.call('ZCARD', queue)
if count + rank < limit then
  local used = {}
  for _, info in ipairs(redis.call('HVALS', hinfo)) do
    used[tonumber(string.match(info, '^(%d+)'))] = true
  end
  local slot = 0
  while used[slot] do slot = slot + 1 end
  local epoch = math.max((tonumber(redis.call('HGET', epochs, slot)) or 0) + 1, now)
  redis.call('HSET', epochs, slot, int(epoch))
  redis.call('ZADD', holders, int(now + ttl), holder)
  redis.call('HSET', hinfo, holder, slot .. '\n' .. int(epoch) .. '\n' .. int(now) .. '\n' .. meta)
  if queued then
    redis.call('ZREM', queue, holder)
    redis.call('ZREM', wexp, holder)
    redis.call('HDEL', winfo, holder)
  end
  touch(declared, epochs, holders, hinfo)
  wake(before)
  return {1, slot, epoch, now + ttl, now, limit}
end

local position = -1
if wait then
  if not queued then
    local ticket = redis.call('HINCRBY', cfg, 'ticket', 1)
    redis.call('ZADD', queue, ticket, holder)
    redis.call('HSET', winfo, holder, client .. '\n' .. int(now) .. '\n' .. meta)
  end
  redis.call('ZADD', wexp, int(now + waiter_ttl), holder)
  position = rank
end
local retry_after = -1
local first = redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')
if #first > 0 then retry_after = math.max(0, tonumber(first[2]) - now) end
touch(declared, queue, wexp, winfo)
wake(before)
return {0, position, retry_after, now, limit}
