-- Shared by every script (prepended at load time). The rules are model.py's State, in Lua.
-- KEYS: the seven keys of one semaphore, all under one hash tag:
--   config  hash  limit, ticket (last issued), touched (last TTL refresh), e:<slot> (fencing
--                 epoch), d:<limit> (declared limit, last seen), pinned ('1': resize pinned
--                 the limit), dl and ds (the newest declaration: its limit, and the start of
--                 the process that made it, us; ds alone, 0: nobody declared yet)
--   holders zset  holder -> lease expiry          hinfo hash  holder -> slot\nepoch\nsince\nmeta
--   queue   zset  holder -> ticket (FIFO order)   wexp  zset  holder -> waiter expiry
--   winfo   hash  holder -> client\nsince\nmeta
--   wfair   hash  holder -> round\nfair key, for waiters queued while the semaphore is fair
--                 (base.py, "Fair shares"); config's 'round' is the highest round admitted
-- ARGV[1] idle TTL (ms), ARGV[2] wake channel prefix, ARGV[3] semaphore name; then per script.
-- (acquire_all.lua gets the keys of several semaphores and points these locals at each in turn.)
-- Time is the server's, in microseconds; every score of holders and wexp is an absolute expiry.
local config, holders, hinfo, queue, wexp, winfo, wfair =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local idle_ms, channel_prefix, name = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

-- Lua formats numbers with 14 significant digits; microsecond times need 16.
local function int(x) return string.format('%d', x) end

-- Counters and histograms (celery_semaphore/stats.py): fields 's:<name>' of config, changed in
-- the same script as what they count. STAT_BUCKETS (bucket bounds, us) is prepended at load
-- time from stats.BUCKETS. Only called where config exists (a HINCRBY would create it with
-- no TTL).
local function stat(field, n) redis.call('HINCRBY', config, 's:' .. field, n) end
local function observe(histogram, us)
  if us < 0 then us = 0 end
  local index = #STAT_BUCKETS
  for i, bound in ipairs(STAT_BUCKETS) do
    if us <= bound then index = i - 1 break end
  end
  redis.call('HINCRBY', config, 's:' .. histogram .. ':' .. index, 1)
  redis.call('HINCRBY', config, 's:' .. histogram .. '_sum', int(us))
end

-- Run a variadic command over many members without overflowing Lua's stack.
local function each_chunk(command, key, members, out)
  for i = 1, #members, 500 do
    local reply = redis.call(command, key, unpack(members, i, math.min(i + 499, #members)))
    if out then for _, v in ipairs(reply) do table.insert(out, v) end end
  end
  return out
end

local function prune_holders()
  local dead = redis.call('ZRANGEBYSCORE', holders, '-inf', int(now))
  if #dead > 0 then
    each_chunk('ZREM', holders, dead)
    each_chunk('HDEL', hinfo, dead)
    if redis.call('EXISTS', config) == 1 then stat('expired', #dead) end
  end
end

local function prune_waiters()
  local gone = redis.call('ZRANGEBYSCORE', wexp, '-inf', int(now))
  if #gone > 0 then
    each_chunk('ZREM', wexp, gone)
    each_chunk('ZREM', queue, gone)
    each_chunk('HDEL', winfo, gone)
    each_chunk('HDEL', wfair, gone)
  end
end

-- Fair shares (model.py's State.queue, fair, next_round). A wfair entry: round, fair key.
local function fair_entry(info)
  if not info then return 0, '' end
  local r, k = string.match(info, '^(%d+)\n(.*)$')
  return tonumber(r), k
end

-- The waiters in admission order: by ticket, or by (round, ticket) while wfair exists.
local function in_order()
  local members = redis.call('ZRANGE', queue, 0, -1)
  if #members == 0 or redis.call('EXISTS', wfair) == 0 then return members end
  local infos = each_chunk('HMGET', wfair, members, {})
  local ranked = {}
  for i, h in ipairs(members) do ranked[i] = {(fair_entry(infos[i])), i, h} end
  table.sort(ranked, function(a, b)
    if a[1] ~= b[1] then return a[1] < b[1] end
    return a[2] < b[2]
  end)
  local out = {}
  for i, r in ipairs(ranked) do out[i] = r[3] end
  return out
end

-- The round a waiter of fair key `key` ('' for none) that queues now gets.
local function next_round(key)
  local r = tonumber(redis.call('HGET', config, 'round') or 0)
  for _, info in ipairs(redis.call('HVALS', wfair)) do
    local wr, wk = fair_entry(info)
    if wk == key and wr > r then r = wr end
  end
  return r + 1
end

-- The task a holder id names ('<task id>:<random>'), or nil.
local function task_of(h) return string.match(h, '^(.*):') end

-- The waiters the FIFO rule admits now: the first (limit - holders) of the queue, but those
-- whose task another holder holds (they keep their place until that twin goes).
local function admissible(limit)
  local free = limit - redis.call('ZCARD', holders)
  if free <= 0 then return {} end
  local first, out, held = nil, {}, nil
  if redis.call('EXISTS', wfair) == 1 then
    first = {unpack(in_order(), 1, free)}
  else
    first = redis.call('ZRANGE', queue, 0, free - 1)
  end
  for _, h in ipairs(first) do
    local task = task_of(h)
    if task and not held then
      held = {}
      for _, k in ipairs(redis.call('HKEYS', hinfo)) do
        local t = task_of(k)
        if t then held[t] = true end
      end
    end
    if not (task and held[task]) then table.insert(out, h) end
  end
  return out
end

-- Every script that changes state starts here: remember which waiters were admissible before
-- anything changes (nil when nobody waits, so the fast path costs one ZCARD), then prune.
local function begin()
  local before = nil
  if redis.call('ZCARD', queue) > 0 then
    before = {}
    local limit = tonumber(redis.call('HGET', config, 'limit'))
    if limit then
      for _, h in ipairs(admissible(limit)) do before[h] = true end
    end
    prune_waiters()
  end
  prune_holders()
  return before
end

-- ...and ends here: notify each waiter this operation made admissible, on the channel of the
-- process that queued it. A waiter queued by this very operation is never admissible, so when
-- nobody waited before (before == nil) there is nobody to wake.
local function wake(before)
  if not before then return end
  local limit = tonumber(redis.call('HGET', config, 'limit'))
  if not limit then return end
  for _, h in ipairs(admissible(limit)) do
    if not before[h] then
      local info = redis.call('HGET', winfo, h)
      if info then
        redis.call('PUBLISH', channel_prefix .. string.match(info, '^[^\n]*'), name .. '\n' .. h)
      end
    end
  end
end

-- Expiry: a semaphore's keys must outlive its use by idle_ms, but a PEXPIRE on every key of
-- every call costs a fifth of a call's server time. So a key this call created gets its TTL at
-- once, and when config's 'touched' time is older than idle_ms / 16 (or unknown) the call
-- refreshes every key. No key expires while the semaphore is used at least every 15/16 of
-- idle_ms; an idle one is gone within idle_ms. Removing members never needs a TTL: a key keeps
-- its own, and an emptied key is deleted by Redis.
local function keep(touched, ...)
  if not touched or now - tonumber(touched) > idle_ms * 1000 / 16 then
    redis.call('HSET', config, 'touched', int(now))
    for _, key in ipairs({config, holders, hinfo, queue, wexp, winfo, wfair}) do
      redis.call('PEXPIRE', key, idle_ms)
    end
  else
    for _, key in ipairs({...}) do redis.call('PEXPIRE', key, idle_ms) end
  end
end

-- Declared limits not seen for idle_ms are forgotten (status also hides them).
local function prune_declared()
  local fields = redis.call('HGETALL', config)
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 2) == 'd:' and tonumber(fields[i + 1]) < now - idle_ms * 1000 then
      redis.call('HDEL', config, fields[i])
    end
  end
end

-- acquire.lua and acquire_all.lua (model.py's State.place, grant, queue_up) ------------------

-- The place of a caller that does not hold: its rank in the queue (as queued, or where it
-- would queue), whether it is queued, and its fair-share round. `before` is begin()'s.
local function place(holder, fair_key, before)
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
  return rank, queued, round
end

-- Give `holder` the lowest free `slot` (whose last epoch was `last_epoch`), leaving the queue;
-- `count` holders held before. Returns the new epoch.
local function grant(holder, slot, last_epoch, limit, declared_limit, ttl, meta, queued, round,
                     count, touched)
  local epoch = math.max(last_epoch + 1, now)
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
  return epoch
end

-- Queue `holder` (or refresh its entry) at the place place() found.
local function queue_up(holder, queued, round, fair_key, meta, client, waiter_ttl)
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
end

-- Seconds (us) until the earliest lease expires, -1 when nobody holds.
local function retry_after()
  local first = redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')
  if #first > 0 then return math.max(0, tonumber(first[2]) - now) end
  return -1
end

-- Limits follow the code (model.py's effective_limit and State.declare): the newest
-- declaration (latest process start `stamp`, us, clamped to now; between equal stamps the
-- latest call) is in force unless the limit is pinned. Returns the limit in force, nil when
-- the semaphore does not exist yet (the caller creates it with `declared`). Writes only what
-- changed. A config stored before limits followed the code (no 'ds') keeps its limit pinned
-- when no caller declared it: an upgrade undoes no operator's resize.
local function declare(declared, stamp)
  local cfg = redis.call('HMGET', config, 'limit', 'pinned', 'dl', 'ds')
  local limit, pinned, wanted, since = tonumber(cfg[1]), cfg[2] == '1', tonumber(cfg[3]),
    tonumber(cfg[4])
  stamp = math.min(stamp, now)
  if limit and not since and not pinned and redis.call('HEXISTS', config, 'd:' .. limit) == 0 then
    pinned = true
    redis.call('HSET', config, 'pinned', '1')
  end
  if not wanted or stamp > since or (stamp == since and declared ~= wanted) then
    wanted, since = declared, stamp
    redis.call('HSET', config, 'dl', wanted, 'ds', int(since))
  end
  if limit and not pinned and limit ~= wanted then
    limit = wanted
    redis.call('HSET', config, 'limit', limit)
  end
  return limit
end
