-- ARGV[4] holder, [5] declared limit, [6] ttl (us), [7] meta JSON, [8] wait (0/1),
-- [9] client id, [10] waiter ttl (us), [11] fair-share key ('' for none).
-- Returns {1, slot, epoch, expires, now, limit} when admitted (or already holding), else
-- {0, position (-1: not queued), retry_after (us, -1: nobody holds), now, limit}.
local holder, declared_limit, ttl = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local meta, wait, client, waiter_ttl = ARGV[7], ARGV[8] == '1', ARGV[9], tonumber(ARGV[10])
local fair_key = ARGV[11] or ''

local before = begin()

-- One read of the holders gives the re-acquire check, their count, the lowest free slot and
-- any twin (another holder of this holder's task: while it holds, this one is not admitted).
local infos = redis.call('HGETALL', hinfo)
local count = #infos / 2
local used, mine, twin, task = {}, nil, false, task_of(holder)
for i = 1, #infos, 2 do
  used[tonumber(string.match(infos[i + 1], '^%d+'))] = true
  if infos[i] == holder then mine = infos[i + 1]
  elseif task and task_of(infos[i]) == task then twin = true end
end
local slot = 0
while used[slot] do slot = slot + 1 end

-- The stored limit rules; the caller's declared limit only creates a new semaphore.
local cfg = redis.call('HMGET', config, 'limit', 'touched', 'e:' .. slot)
local limit = tonumber(cfg[1]) or declared_limit
local touched = cfg[2]

if mine then  -- a current holder gets its grant back unchanged
  local held_slot, epoch = string.match(mine, '^(%d+)\n(%d+)\n')
  local expires = tonumber(redis.call('ZSCORE', holders, holder))
  -- the limit too: a config that expired on its own must not come back without one
  redis.call('HSET', config, 'limit', limit, 'd:' .. declared_limit, int(now))
  keep(touched)
  wake(before)
  return {1, tonumber(held_slot), tonumber(epoch), expires, now, limit}
end

local rank, queued, round = 0, false, 0
if before then
  rank = redis.call('ZRANK', queue, holder)
  queued = rank ~= false
  if not queued then rank = redis.call('ZCARD', queue) end
end
-- Fair shares (base.py): a queued waiter keeps its round; a newcomer gets one while fair.
local fair = redis.call('EXISTS', wfair) == 1
if queued then
  if fair then
    round = fair_entry(redis.call('HGET', wfair, holder))
    for i, h in ipairs(in_order()) do
      if h == holder then rank = i - 1 break end
    end
  end
elseif fair or fair_key ~= '' then
  round = next_round(fair_key)
  if before then
    rank = 0
    local waiting = redis.call('ZRANGE', queue, 0, -1)
    local infos = fair and each_chunk('HMGET', wfair, waiting, {}) or {}
    for i = 1, #waiting do
      if fair_entry(infos[i]) <= round then rank = rank + 1 end
    end
  end
end

if count + rank < limit and not twin then
  -- count < limit, so the lowest free slot is below the limit.
  local epoch = math.max((tonumber(cfg[3]) or 0) + 1, now)
  redis.call('HSET', config, 'limit', limit, 'd:' .. declared_limit, int(now),
    'e:' .. slot, int(epoch))
  redis.call('ZADD', holders, int(now + ttl), holder)
  redis.call('HSET', hinfo, holder, slot .. '\n' .. int(epoch) .. '\n' .. int(now) .. '\n' .. meta)
  -- the wait: from the caller's first wait (meta), else from its entry in the queue
  local since = tonumber(string.match(meta, '"first_wait":([%d%.]+)') or '')
  if since then since = since * 1000000
  elseif queued then since = tonumber(string.match(redis.call('HGET', winfo, holder), '\n(%d+)'))
  else since = now end
  stat('acquired', 1)
  observe('wait', now - since)
  if queued then
    redis.call('ZREM', queue, holder)
    redis.call('ZREM', wexp, holder)
    redis.call('HDEL', winfo, holder)
    redis.call('HDEL', wfair, holder)
  end
  if round > tonumber(redis.call('HGET', config, 'round') or 0) then
    redis.call('HSET', config, 'round', round)
  end
  if count == 0 then keep(touched, holders, hinfo) else keep(touched) end
  wake(before)
  return {1, slot, epoch, now + ttl, now, limit}
end

redis.call('HSET', config, 'limit', limit, 'd:' .. declared_limit, int(now))
local position = -1
if wait then
  if not queued then
    local ticket = redis.call('HINCRBY', config, 'ticket', 1)
    redis.call('ZADD', queue, ticket, holder)
    redis.call('HSET', winfo, holder, client .. '\n' .. int(now) .. '\n' .. meta)
    if round > 0 then
      redis.call('HSET', wfair, holder, round .. '\n' .. fair_key)
      redis.call('PEXPIRE', wfair, idle_ms)
    end
  end
  redis.call('ZADD', wexp, int(now + waiter_ttl), holder)
  position = rank
end
-- A waiter added to an empty queue created the queue's keys.
if wait and not queued and rank == 0 then keep(touched, queue, wexp, winfo) else keep(touched) end
local retry_after = -1
local first = redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')
if #first > 0 then retry_after = math.max(0, tonumber(first[2]) - now) end
wake(before)
return {0, position, retry_after, now, limit}
