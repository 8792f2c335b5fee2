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
-- Costs, priorities and rates (base.py): a queue score is ticket - priority * PRIO, so the queue
-- is in (-priority, ticket) order; a caller's cost k > 1 is the first field of its meta JSON
-- ('{"cost":k,...'); config's 'xh' and 'xw' are the sum of (cost - 1) over holders, resp.
-- waiters (absent: every cost is 1, and nothing below looks at a cost); 'ri' (interval, us),
-- 'rb' (burst) and 'tat' (theoretical arrival time, us) are the rate's GCRA, when it has one.
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

-- Priorities live in the queue's scores: ticket - priority * PRIO (tickets stay below PRIO).
local PRIO = 68719476736
local function prio_of(score) return math.ceil(-tonumber(score) / PRIO) end
-- The cost a hinfo or winfo entry's meta carries (1 when none; false: a missing entry).
local function cost_in(info)
  if not info then return 1 end
  return tonumber(string.match(info, '\n{"cost":(%d+)') or 1)
end
-- Sum of (cost - 1) over the hinfo or winfo entries `infos`.
local function extra_in(infos)
  local extra = 0
  for _, info in ipairs(infos) do extra = extra + cost_in(info) - 1 end
  return extra
end

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
    if tonumber(redis.call('HGET', config, 'xh') or 0) > 0 then
      local extra = extra_in(each_chunk('HMGET', hinfo, dead, {}))
      if extra > 0 then redis.call('HINCRBY', config, 'xh', -extra) end
    end
    each_chunk('HDEL', hinfo, dead)
    if redis.call('EXISTS', config) == 1 then stat('expired', #dead) end
  end
end

local function prune_waiters()
  local gone = redis.call('ZRANGEBYSCORE', wexp, '-inf', int(now))
  if #gone > 0 then
    each_chunk('ZREM', wexp, gone)
    if tonumber(redis.call('HGET', config, 'xw') or 0) > 0 then
      local extra = extra_in(each_chunk('HMGET', winfo, gone, {}))
      if extra > 0 then redis.call('HINCRBY', config, 'xw', -extra) end
    end
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

-- The queue's members with their priority and round, in the queue's (score) order.
local function entries()
  local scored = redis.call('ZRANGE', queue, 0, -1, 'WITHSCORES')
  local members = {}
  for i = 1, #scored, 2 do members[#members + 1] = scored[i] end
  local infos = each_chunk('HMGET', wfair, members, {})
  local out = {}
  for i, h in ipairs(members) do
    out[i] = {prio_of(scored[2 * i]), (fair_entry(infos[i])), i, h}
  end
  return out
end

-- The waiters in admission order: by (-priority, ticket) (the queue's order), or by
-- (-priority, round, ticket) while wfair exists.
local function in_order()
  if redis.call('EXISTS', wfair) == 0 then return redis.call('ZRANGE', queue, 0, -1) end
  local ranked = entries()
  table.sort(ranked, function(a, b)
    if a[1] ~= b[1] then return a[1] > b[1] end
    if a[2] ~= b[2] then return a[2] < b[2] end
    return a[3] < b[3]
  end)
  local out = {}
  for i, r in ipairs(ranked) do out[i] = r[4] end
  return out
end

-- The round a waiter of fair key `key` ('' for none) and fair weight `weight` that queues
-- now gets (base.py, "Weights").
local function next_round(key, weight)
  local r = tonumber(redis.call('HGET', config, 'round') or 0)
  local last, n = 0, 0
  for _, info in ipairs(redis.call('HVALS', wfair)) do
    local wr, wk = fair_entry(info)
    if wk == key then
      if wr > last then last, n = wr, 1 elseif wr == last then n = n + 1 end
    end
  end
  if weight > 1 and last > r and n < weight then return last end
  return math.max(r, last) + 1
end

-- Seconds (us) until the rate allows the start of a caller with `ahead` waiters before it
-- (<= 0: now). ri nil: no rate.
local function rate_wait(ri, rb, tat, ahead)
  if not ri then return 0 end
  return math.max(tat or 0, now) + (ahead - (rb - 1)) * ri - now
end

-- The task a holder id names ('<task id>:<random>'), or nil.
local function task_of(h) return string.match(h, '^(.*):') end

-- The waiters the FIFO rule admits now: the longest prefix of the queue whose costs fit in
-- the free units, but those whose task another holder holds (they keep their place until that
-- twin goes); none while the rate allows no start (a rate-held waiter is told when to try).
local function admissible()
  local c = redis.call('HMGET', config, 'limit', 'xh', 'xw', 'ri', 'rb', 'tat')
  local limit = tonumber(c[1])
  if not limit then return {} end
  local free = limit - redis.call('ZCARD', holders) - (tonumber(c[2]) or 0)
  if free <= 0 then return {} end
  if c[4] and rate_wait(tonumber(c[4]), tonumber(c[5]), tonumber(c[6]), 0) > 0 then
    return {}
  end
  local first, out, held = nil, {}, nil
  if redis.call('EXISTS', wfair) == 1 then
    first = {unpack(in_order(), 1, free)}
  else
    first = redis.call('ZRANGE', queue, 0, free - 1)
  end
  if (tonumber(c[3]) or 0) > 0 and #first > 0 then  -- costs: as many as fit, in order
    local infos = each_chunk('HMGET', winfo, first, {})
    for i = 1, #first do
      free = free - cost_in(infos[i])
      if free < 0 then first = {unpack(first, 1, i - 1)} break end
    end
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
    for _, h in ipairs(admissible()) do before[h] = true end
    prune_waiters()
  end
  prune_holders()
  return before
end

-- Defined below (it grants, which needs what follows): grants an admissible waiter that asked
-- for pushed grants, and announces the grant on its channel.
local push_grant

-- ...and ends here: every waiter admissible now that asked for pushed grants (winfo's client
-- field 'client ttl', ttl in us) is granted at once (base.py, "Pushed grants"), and each other
-- waiter this operation made admissible is notified, on the channel of the process that
-- queued it. A waiter queued by this very operation is never admissible, so when nobody waited
-- before (before == nil) there is nobody to wake. With a rate, one grant at most is pushed per
-- operation (each start moves the rate's next one); the others are woken and try.
local function wake(before)
  if not before then return end
  local rated, pushed_tasks = nil, {}
  for i, h in ipairs(admissible()) do
    local info = redis.call('HGET', winfo, h)
    if info then
      local client, pushed = string.match(info, '^([^\n ]*) ?(%d*)')
      if rated == nil then rated = redis.call('HEXISTS', config, 'ri') == 1 end
      local task = task_of(h)
      -- (two queued deliveries of one task: the second waits for its twin)
      if pushed ~= '' and (i == 1 or not rated) and not (task and pushed_tasks[task]) then
        if task then pushed_tasks[task] = true end
        push_grant(h, info, tonumber(pushed), client)
      elseif not before[h] then
        redis.call('PUBLISH', channel_prefix .. client, name .. '\n' .. h)
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

-- An empty semaphore (nobody holds or waits, no pinned limit) keeps its config for EMPTY_MS
-- only (base.py's EMPTY_TTL), or until its rate's next start is due if later, at most idle_ms;
-- 'touched' goes, so that the next use gives every key idle_ms again (keep). The other keys are
-- empty, so Redis has deleted them, but wfair, which keeps its TTL.
local function forget_if_empty()
  if redis.call('ZCARD', holders) > 0 or redis.call('ZCARD', queue) > 0
      or redis.call('HGET', config, 'pinned') == '1' then
    return
  end
  local ms = EMPTY_MS
  local tat = redis.call('HGET', config, 'tat')
  if tat then ms = math.max(ms, math.ceil((tonumber(tat) - now) / 1000) + 1000) end
  ms = math.min(ms, idle_ms)
  redis.call('HDEL', config, 'touched')
  redis.call('PEXPIRE', config, ms)
  redis.call('PEXPIRE', wfair, ms)
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

-- Take `holder` out of the queue (`xw`: config's, nil: read it).
local function unqueue(holder, xw)
  xw = xw or tonumber(redis.call('HGET', config, 'xw') or 0)
  if xw > 0 then
    local cost = cost_in(redis.call('HGET', winfo, holder))
    if cost > 1 then redis.call('HINCRBY', config, 'xw', 1 - cost) end
  end
  redis.call('ZREM', queue, holder)
  redis.call('ZREM', wexp, holder)
  redis.call('HDEL', winfo, holder)
  redis.call('HDEL', wfair, holder)
end

-- The place of a caller that does not hold: its rank in the queue (as queued, or where it
-- would queue), whether it is queued, its fair-share round, and the units the waiters ahead
-- of it need. `before` is begin()'s; `tr` the caller's traffic (priority, weight) and config's
-- xw.
local function place(holder, fair_key, before, tr)
  local rank, queued, round = 0, false, 0
  if before then
    rank = redis.call('ZRANK', queue, holder)
    queued = rank ~= false
    -- a newcomer ranks behind every waiter of its priority or a higher one
    if not queued then
      rank = redis.call('ZCOUNT', queue, '-inf', '(' .. int((1 - tr.priority) * PRIO))
    end
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
    round = next_round(fair_key, tr.weight)
    if before then
      rank = 0
      for _, e in ipairs(entries()) do
        if e[1] > tr.priority or (e[1] == tr.priority and e[2] <= round) then
          rank = rank + 1
        end
      end
    end
  end
  local ahead = rank
  if tr.xw > 0 and rank > 0 then  -- costs: the units of the waiters ahead
    local first
    if fair then first = {unpack(in_order(), 1, rank)}
    else first = redis.call('ZRANGE', queue, 0, rank - 1) end
    ahead = rank + extra_in(each_chunk('HMGET', winfo, first, {}))
  end
  return rank, queued, round, ahead
end

-- The traffic options of a call (ARGV from `at`: cost, priority, weight, rate interval (us,
-- '' for none), burst) and config's fields c = {xh, xw, ri, rb, tat}; a declared rate
-- becomes the semaphore's (base.py, "Rate").
local function traffic(at, c)
  local tr = {cost = tonumber(ARGV[at]) or 1, priority = tonumber(ARGV[at + 1]) or 0,
              weight = tonumber(ARGV[at + 2]) or 1, xh = tonumber(c[1]) or 0,
              xw = tonumber(c[2]) or 0, ri = tonumber(c[3]), rb = tonumber(c[4]),
              tat = tonumber(c[5])}
  local ri, rb = tonumber(ARGV[at + 3] or ''), tonumber(ARGV[at + 4] or '')
  if ri and (ri ~= tr.ri or rb ~= tr.rb) then
    redis.call('HSET', config, 'ri', ri, 'rb', rb)
    tr.ri, tr.rb = ri, rb
  end
  return tr
end

-- The verdict for a caller at `rank` needing `ahead` units before its own, with `count`
-- holders: admitted (true), else what it waits for (0 slots, 1 units, 2 rate) and, for the
-- rate, when its start is due (us, else -1).
local function verdict(tr, count, rank, ahead, limit, twin)
  local fits = count + tr.xh + ahead + tr.cost <= limit
  local due = rate_wait(tr.ri, tr.rb, tr.tat, rank)
  if fits and not twin and due <= 0 then return true, 0, -1 end
  if fits and not twin then return false, 2, due end
  if tr.cost > 1 or tr.xh > 0 or ahead > rank then return false, 1, -1 end
  return false, 0, -1
end

-- Give `holder` the lowest free `slot` (whose last epoch was `last_epoch`), leaving the queue;
-- `count` holders held before. Returns the new epoch.
local function grant(holder, slot, last_epoch, limit, declared_limit, ttl, meta, queued, round,
                     count, touched, tr)
  local epoch = math.max(last_epoch + 1, now)
  if declared_limit then
    redis.call('HSET', config, 'limit', limit, 'd:' .. declared_limit, int(now),
      'e:' .. slot, int(epoch))
  else  -- a pushed grant: the waiter declared its limit when it queued
    redis.call('HSET', config, 'e:' .. slot, int(epoch))
  end
  if tr.cost > 1 then redis.call('HINCRBY', config, 'xh', tr.cost - 1) end
  if tr.ri then  -- a start: the rate's next one is an interval later
    redis.call('HSET', config, 'tat', int(math.max(tr.tat or 0, now) + tr.ri))
  end
  redis.call('ZADD', holders, int(now + ttl), holder)
  redis.call('HSET', hinfo, holder, slot .. '\n' .. int(epoch) .. '\n' .. int(now) .. '\n' .. meta)
  -- the wait: from the caller's first wait (meta), else from its entry in the queue
  local since = tonumber(string.match(meta, '"first_wait":([%d%.]+)') or '')
  if since then since = since * 1000000
  elseif queued then since = tonumber(string.match(redis.call('HGET', winfo, holder), '\n(%d+)'))
  else since = now end
  stat('acquired', 1)
  observe('wait', now - since)
  if queued then unqueue(holder, tr.xw) end
  if round > tonumber(redis.call('HGET', config, 'round') or 0) then
    redis.call('HSET', config, 'round', round)
  end
  if count == 0 then keep(touched, holders, hinfo) else keep(touched) end
  return epoch
end

-- A pushed grant (wake): waiter `h` (its winfo entry `info`, the lease TTL it asked for, the
-- client id of its process) is admissible: grant it the lowest free slot as acquire.lua would,
-- and publish 'name\nholder\nslot\nepoch\nexpires\nnow\nlimit' on its channel.
push_grant = function(h, info, ttl, client)
  local used = {}
  for _, held in ipairs(redis.call('HVALS', hinfo)) do
    used[tonumber(string.match(held, '^%d+'))] = true
  end
  local slot = 0
  while used[slot] do slot = slot + 1 end
  local c = redis.call('HMGET', config, 'limit', 'touched', 'e:' .. slot, 'xh', 'xw', 'ri', 'rb',
    'tat')
  local tr = {cost = cost_in(info), xh = tonumber(c[4]) or 0, xw = tonumber(c[5]) or 0,
              ri = tonumber(c[6]), rb = tonumber(c[7]), tat = tonumber(c[8])}
  local round = fair_entry(redis.call('HGET', wfair, h))
  local meta = string.match(info, '^[^\n]*\n[^\n]*\n(.*)$') or '{}'
  local epoch = grant(h, slot, tonumber(c[3]) or 0, tonumber(c[1]), nil, ttl, meta, true, round,
    redis.call('ZCARD', holders), c[2], tr)
  redis.call('PUBLISH', channel_prefix .. client, name .. '\n' .. h .. '\n' .. slot .. '\n' ..
    int(epoch) .. '\n' .. int(now + ttl) .. '\n' .. int(now) .. '\n' .. c[1])
end

-- Queue `holder` (or refresh its entry) at the place place() found.
local function queue_up(holder, queued, round, fair_key, meta, client, waiter_ttl, tr)
  if not queued then
    local ticket = redis.call('HINCRBY', config, 'ticket', 1)
    redis.call('ZADD', queue, int(ticket - tr.priority * PRIO), holder)
    if tr.cost > 1 then redis.call('HINCRBY', config, 'xw', tr.cost - 1) end
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
