-- Shared by every script (prepended at load time). The rules are model.py's State, in Lua.
-- KEYS: the nine keys of one semaphore, all under one hash tag:
--   config  hash  limit, ticket (last issued), touched (last TTL refresh), e (the last fencing
--                 epoch issued, whatever the slot: one field, so that config stays small
--                 however many slots are used; before, one 'e:<slot>' per slot, taken over
--                 by issued_epoch), d:<limit> (declared limit, last seen), pinned ('1':
--                 resize pinned the limit), dl and ds (the newest declaration: its limit,
--                 and the start of the process that made it, us; ds alone, 0: nobody
--                 declared yet), wn (no waiter expires before then: prune_waiters), pl (no
--                 waiter has a lower priority: queue_up)
--   holders zset  holder -> lease expiry          hinfo hash  holder -> slot\nepoch\nsince\nmeta
--   queue   zset  holder -> ticket (FIFO order)   wexp  zset  holder -> waiter expiry
--   winfo   hash  holder -> client\nsince\nmeta
--   wfair   hash  holder -> round\nfair key, for waiters queued while the semaphore is fair
--                 (base.py, "Fair shares"); config's 'round' is the highest round admitted
--   slots   string  bit s set while a holder holds slot s        htask hash  'o:' .. the task
--                 a holder holds (task_of), or 'h:' .. the holder id when it names no task
--                 -> holder: the holders' index, so that an acquire finds the lowest free slot
--                 and a twin without reading every holder. Kept by every grant and removal
--                 while others hold (a first holder starts none, the last one's going drops
--                 it); check_index builds it from hinfo when it disagrees with holders, and
--                 both keys expire idle_ms after that (keep leaves them: an index that expires
--                 in use is built again).
-- Costs, priorities and rates (base.py): a queue score is ticket - priority * PRIO (- HALF for a
-- waiter at the front of its priority), so the queue is in (-priority, not front, ticket)
-- order; a caller's cost k > 1 is the first field of its meta JSON ('{"cost":k,...'), its units
-- u > 1 the next ('{"cost":k,"units":u,...' or '{"units":u,...'); config's 'xh' and 'xw' are
-- the sum of (cost - 1) over holders, resp. waiters, and 'xu' the sum of (units - 1) over
-- waiters (absent: every cost, resp. every waiter's units, is 1, and nothing below looks at
-- them); 'ri' (interval, us), 'rb' (burst) and 'tat' (theoretical arrival time, us) are the
-- first rate's GCRA, when it has one, 'rn' the number of rates when above 1 and 'ri<i>',
-- 'rb<i>', 'tat<i>' (i >= 2) the others'.
-- Quotas (base.py, "Quotas"): 'qd' the declared ones ('count period offset;...', us; period 0:
-- a calendar month); per (period, offset) the window of its last start 'qs:<p>:<o>' (us) and
-- the units started in it 'qu:<p>:<o>'. A holder whose admission counted in quota windows (or
-- that settled) has a line '@counted;p:o:start;...' before its meta in hinfo.
-- Pauses: 'pu' (end, us) and 'pr' (reason). 'ku': config is kept at least until then (us: the
-- end of the last pause and of every window that counted a start).
-- Adaptive limits (base.py): 'ac' (the learned value; its presence: adaptive), 'am', 'aM',
-- 'ad', 'ai' (min, max, decrease, increase of the newest declaration), 'at' (the last
-- decrease, us), 'ak' (the ceiling: the limit in force at that decrease, until it is passed);
-- the limit in force, 'limit', is floor(ac) unless pinned.
-- ARGV[1] idle TTL (ms), ARGV[2] wake channel prefix, ARGV[3] semaphore name; then per script.
-- (acquire_all.lua gets the keys of several semaphores and points these locals at each in turn.)
-- Time is the server's, in microseconds; every score of holders and wexp is an absolute expiry.
local config, holders, hinfo, queue, wexp, winfo, wfair, slots, htask =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local idle_ms, channel_prefix, name = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

-- The shared functions below are fields of P (P.grant, P.wake, ...), not locals: Redis runs
-- the whole prelude again at every call, and Lua 5.1 links each closure to the locals it uses
-- by walking a list of every local some closure uses so far. With some fifty functions as
-- locals, each calling the others, defining them took 13-19 us of a call's server time
-- against 7-9 us as fields of one table (docs/benchmarks.md, "The prelude's functions in one
-- table").
local P = {}

-- Lua formats numbers with 14 significant digits; microsecond times need 16.
function P.int(x) return string.format('%d', x) end

-- Priorities live in the queue's scores: ticket - priority * PRIO, less HALF for a waiter at the
-- front of its priority (tickets stay below HALF).
local PRIO = 68719476736
local HALF = 34359738368
function P.prio_of(score) return math.floor(-tonumber(score) / PRIO + 0.5) end
function P.front_score(score)
  return -tonumber(score) - P.prio_of(score) * PRIO > 0
end
-- The cost a hinfo or winfo entry's meta carries (1 when none; false: a missing entry).
function P.cost_in(info)
  if not info then return 1 end
  return tonumber(string.match(info, '\n{"cost":(%d+)') or 1)
end
-- The units (of the rates and quotas) a hinfo or winfo entry's meta carries (1 when none).
function P.units_in(info)
  if not info then return 1 end
  return tonumber(string.match(info, '\n{"cost":%d+,"units":(%d+)')
    or string.match(info, '\n{"units":(%d+)') or 1)
end
-- Sum of (cost - 1) over the hinfo or winfo entries `infos`.
function P.extra_in(infos)
  local extra = 0
  for _, info in ipairs(infos) do extra = extra + P.cost_in(info) - 1 end
  return extra
end

-- Counters and histograms (celery_semaphore/stats.py): fields 's:<name>' of config, changed in
-- the same script as what they count. STAT_BUCKETS (bucket bounds, us) is prepended at load
-- time from stats.BUCKETS. Only called where config exists (a HINCRBY would create it with
-- no TTL).
function P.stat(field, n) redis.call('HINCRBY', config, 's:' .. field, n) end
function P.observe(histogram, us)
  if us < 0 then us = 0 end
  local index = #STAT_BUCKETS
  for i, bound in ipairs(STAT_BUCKETS) do
    if us <= bound then index = i - 1 break end
  end
  redis.call('HINCRBY', config, 's:' .. histogram .. ':' .. index, 1)
  redis.call('HINCRBY', config, 's:' .. histogram .. '_sum', P.int(us))
end

-- The task a holder id names ('<task id>:<random>'), or nil.
function P.task_of(h) return string.match(h, '^(.*):') end

-- The holders' index (htask and slots, see KEYS): a holder's field in htask is its task's, or
-- its own when its id names no task (a task has one holder at most: a twin is not admitted).
function P.task_field(h)
  local task = P.task_of(h)
  if task then return 'o:' .. task end
  return 'h:' .. h
end
-- Semaphores (their slots key) whose index this script call has checked (check_index).
local index_checked = {}
-- The index goes (to be built again by the next check_index).
function P.drop_index()
  redis.call('DEL', slots, htask)
  index_checked[slots] = nil
end
-- The index learns that holder `h` holds `slot`...
function P.index_add(h, slot)
  redis.call('SETBIT', slots, slot, 1)
  redis.call('HSET', htask, P.task_field(h), h)
end
-- ...and forgets holder `h` of hinfo entry `info`. A slot it did not have set means the index
-- disagreed with the holders: it is dropped, to be built again by the next check_index.
function P.index_remove(h, info)
  redis.call('HDEL', htask, P.task_field(h))
  if redis.call('SETBIT', slots, tonumber(string.match(info, '^%d+')), 0) == 0 then
    P.drop_index()
  end
end
-- The index agrees with the holders (one slot bit set per holder) or is built again from hinfo
-- (O(holders), once: a semaphore's first holder starts no index, its last one drops it; or an
-- index that expired or was evicted apart from its holders, or state written before the index
-- existed). Called once per semaphore and script (until the index is dropped or a grant to an
-- empty semaphore leaves it behind), after the pruning and before any grant but the first,
-- with the holders' count.
function P.check_index(count)
  if index_checked[slots] then return end
  index_checked[slots] = true
  if redis.call('BITCOUNT', slots) == count then return end
  P.drop_index()
  index_checked[slots] = true
  local infos = redis.call('HGETALL', hinfo)
  for i = 1, #infos, 2 do P.index_add(infos[i], tonumber(string.match(infos[i + 1], '^%d+'))) end
  if #infos > 0 then  -- both to the same millisecond: neither is ever there without the other
    local at = math.floor(now / 1000) + idle_ms
    redis.call('PEXPIREAT', slots, at)
    redis.call('PEXPIREAT', htask, at)
  end
end
-- Whether `h` holds (the index names a twin: it is trusted only while that twin holds).
function P.holds(h) return redis.call('ZSCORE', holders, h) ~= false end
-- The lowest slot none of `count` holders holds.
function P.free_slot(count)
  if count == 0 then return 0 end
  P.check_index(count)
  return redis.call('BITPOS', slots, 0)
end

-- Run a variadic command over many members without overflowing Lua's stack.
function P.each_chunk(command, key, members, out)
  for i = 1, #members, 500 do
    local reply = redis.call(command, key, unpack(members, i, math.min(i + 499, #members)))
    if out then for _, v in ipairs(reply) do table.insert(out, v) end end
  end
  return out
end

-- Each semaphore's (holders key's) first lease {holder, expiry} as this call's pruning found
-- it ({}: nobody holds), for retry_after, until this call adds or removes a holder
-- (P.holders_changed).
local first_lease = {}
function P.holders_changed() first_lease[holders] = nil end

-- Both prunes return how many they took out. Where somebody waits (`waited`: a queue entry
-- needs retry_after), the holders' first lease says whether any has expired (one command
-- either way; where nobody waits, the shorter reply of none).
function P.prune_holders(waited)
  first_lease[holders] = nil
  if waited then
    local first = redis.call('ZRANGEBYSCORE', holders, '-inf', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if #first == 0 or tonumber(first[2]) > now then
      first_lease[holders] = first
      return 0
    end
  end
  local dead = redis.call('ZRANGEBYSCORE', holders, '-inf', P.int(now))
  if #dead > 0 then
    P.each_chunk('ZREM', holders, dead)
    local infos = P.each_chunk('HMGET', hinfo, dead, {})
    for i, h in ipairs(dead) do
      if infos[i] then P.index_remove(h, infos[i]) end
    end
    if tonumber(redis.call('HGET', config, 'xh') or 0) > 0 then
      local extra = P.extra_in(infos)
      if extra > 0 then redis.call('HINCRBY', config, 'xh', -extra) end
    end
    P.each_chunk('HDEL', hinfo, dead)
    if redis.call('EXISTS', config) == 1 then P.stat('expired', #dead) end
  end
  return #dead
end

-- Waiters: config's 'wn' is at or before every waiter's expiry (queue_up lowers it for an
-- earlier one; a waiter that leaves or expires later leaves it early), so begin prunes only
-- once 'wn' has passed (or is unknown), and the pruning sets it to the next expiry (`write`:
-- config exists, so that a 'wn' does not create it). Returns how many expired, and 'wn' now.
function P.prune_waiters(write)
  local gone = redis.call('ZRANGEBYSCORE', wexp, '-inf', P.int(now))
  if #gone > 0 then
    P.each_chunk('ZREM', wexp, gone)
    local x = redis.call('HMGET', config, 'xw', 'xu')
    if tonumber(x[1] or 0) > 0 or tonumber(x[2] or 0) > 0 then
      local infos = P.each_chunk('HMGET', winfo, gone, {})
      local extra, more = 0, 0
      for _, info in ipairs(infos) do
        extra, more = extra + P.cost_in(info) - 1, more + P.units_in(info) - 1
      end
      if extra > 0 then redis.call('HINCRBY', config, 'xw', -extra) end
      if more > 0 then redis.call('HINCRBY', config, 'xu', -more) end
    end
    P.each_chunk('ZREM', queue, gone)
    P.each_chunk('HDEL', winfo, gone)
    P.each_chunk('HDEL', wfair, gone)
  end
  local next = redis.call('ZRANGE', wexp, 0, 0, 'WITHSCORES')[2] or false
  if next and write then redis.call('HSET', config, 'wn', next)
  elseif not next then redis.call('HDEL', config, 'wn') end
  return #gone, next
end

-- Fair shares (model.py's State.queue, fair, next_round). A wfair entry: round, fair key.
function P.fair_entry(info)
  if not info then return 0, '' end
  local r, k = string.match(info, '^(%d+)\n(.*)$')
  return tonumber(r), k
end

-- The queue's members with their priority, round, place and front flag, in the queue's (score)
-- order.
function P.entries()
  local scored = redis.call('ZRANGE', queue, 0, -1, 'WITHSCORES')
  local members = {}
  for i = 1, #scored, 2 do members[#members + 1] = scored[i] end
  local infos = P.each_chunk('HMGET', wfair, members, {})
  local out = {}
  for i, h in ipairs(members) do
    out[i] = {P.prio_of(scored[2 * i]), (P.fair_entry(infos[i])), i, h,
              P.front_score(scored[2 * i])}
  end
  return out
end

-- The waiters in admission order: by (-priority, not front, ticket) (the queue's order), or by
-- (-priority, not front, round, ticket) while wfair exists (a front waiter's round is 0, and it
-- comes before the others of its priority in the queue's order).
function P.in_order()
  if redis.call('EXISTS', wfair) == 0 then return redis.call('ZRANGE', queue, 0, -1) end
  local ranked = P.entries()
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
function P.next_round(key, weight)
  local r = tonumber(redis.call('HGET', config, 'round') or 0)
  local last, n = 0, 0
  for _, info in ipairs(redis.call('HVALS', wfair)) do
    local wr, wk = P.fair_entry(info)
    if wk == key then
      if wr > last then last, n = wr, 1 elseif wr == last then n = n + 1 end
    end
  end
  if weight > 1 and last > r and n < weight then return last end
  return math.max(r, last) + 1
end

-- Calendar windows (base.py's window_of): days from 1970-01-01 to the first of a month, and the
-- year and month of a day.
local DAY = 86400000000
function P.days_of(y, m)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m + 9
  if m > 2 then mp = m - 3 end
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100)
    + math.floor((153 * mp + 2) / 5)
  return era * 146097 + doe - 719468
end
function P.civil(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp + 3
  if mp >= 10 then m = mp - 9 end
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end
-- The window of quota (period p, offset o; us) holding now: start, end.
function P.window_of(p, o)
  if p > 0 then
    local s = math.floor((now + o) / p) * p - o
    return s, s + p
  end
  local y, m = P.civil(math.floor((now + o) / DAY))
  local ny, nm = y, m + 1
  if nm == 13 then ny, nm = y + 1, 1 end
  return P.days_of(y, m) * DAY - o, P.days_of(ny, nm) * DAY - o
end

-- The rates and quotas of the semaphore (tr.rates: {interval, burst, tat} each; tr.quotas:
-- {count, period, offset, start, end, used in the current window} each) from config's fields
-- ri, rb, tat, rn and qd (the values given: read already), or nil for none.
function P.rates_of(ri, rb, tat, rn)
  if not ri then return nil end
  local rates = {{tonumber(ri), tonumber(rb), tonumber(tat) or 0}}
  rn = tonumber(rn) or 1
  if rn > 1 then
    local fields = {}
    for i = 2, rn do
      table.insert(fields, 'ri' .. i) table.insert(fields, 'rb' .. i)
      table.insert(fields, 'tat' .. i)
    end
    local v = redis.call('HMGET', config, unpack(fields))
    for i = 2, rn do
      local k = (i - 2) * 3
      rates[i] = {tonumber(v[k + 1]), tonumber(v[k + 2]), tonumber(v[k + 3]) or 0}
    end
  end
  return rates
end
function P.quotas_of(qd)
  if not qd or qd == '' then return nil end
  local quotas, fields = {}, {}
  for c, p, o in string.gmatch(qd, '(%d+) (%d+) (%-?%d+)') do
    local q = {tonumber(c), tonumber(p), tonumber(o)}
    q[4], q[5] = P.window_of(q[2], q[3])
    table.insert(quotas, q)
    table.insert(fields, 'qs:' .. p .. ':' .. o) table.insert(fields, 'qu:' .. p .. ':' .. o)
  end
  local v = redis.call('HMGET', config, unpack(fields))
  for i, q in ipairs(quotas) do
    q[6] = 0
    if tonumber(v[2 * i - 1]) == q[4] then q[6] = tonumber(v[2 * i]) or 0 end
  end
  return quotas
end

-- Seconds (us) until every rate allows the start of `units` units by a caller with `ahead`
-- units of waiters before it (<= 0: now); rates nil: no rate.
function P.rates_wait(rates, ahead, units)
  local wait = 0
  for _, r in ipairs(rates or {}) do
    wait = math.max(wait, math.max(r[3], now) + (ahead - math.max(0, r[2] - units)) * r[1] - now)
  end
  return wait
end
-- Seconds (us) until the last quota window without room for `units` units after `ahead` turns
-- (0: room in every one).
function P.quota_wait(quotas, ahead, units)
  local wait = 0
  for _, q in ipairs(quotas or {}) do
    if q[6] + ahead + units > q[1] then wait = math.max(wait, q[5] - now) end
  end
  return wait
end

-- The holders as an acquire of `holder` needs them, from their index (a few commands, however
-- many hold), given their `count`: the lowest slot none of them uses, `holder`'s own hinfo
-- entry (nil: it holds nothing) and whether another holder holds its task (a twin).
function P.read_holders(holder, count)
  local mine, twin = nil, false
  if count > 0 then
    P.check_index(count)
    local held_by = redis.call('HGET', htask, P.task_field(holder))
    if held_by == holder then mine = redis.call('HGET', hinfo, holder)
    elseif held_by then twin = P.holds(held_by) end
  end
  return P.free_slot(count), mine, twin
end
-- Whether another of `count` holders holds the task of `holder`, who does not hold.
function P.read_twin(holder, count)
  if count == 0 or not P.task_of(holder) then return false end
  P.check_index(count)
  local held_by = redis.call('HGET', htask, P.task_field(holder))
  return held_by ~= false and held_by ~= holder and P.holds(held_by)
end

-- The waiters the rules admit now (model.py's State.admissible): none while a pause is in
-- force or while the rates allow the head no start (a waiter held back by time is told when to
-- try); else the longest prefix of the queue whose costs fit in the free units and whose units
-- fit in every quota, but those whose task another holder holds (they keep their place until
-- that twin goes). `view` (optional): filled with what was read on the way, for the grants
-- that follow in the same script: config's fields `c` (VIEW_FIELDS), the holders' `count` and
-- whether the semaphore is `fair`. A view that has `c` (and `count`) already is taken as
-- current instead of reading them again: its owner keeps it so (begin, release.lua).
-- (a caller that wants more of config in the same read names them all: `view.fields`, these
-- first; a `c` it read itself starts with these too)
local VIEW_FIELDS = {'limit', 'xh', 'xw', 'ri', 'rb', 'tat', 'pu', 'xu', 'rn', 'qd', 'touched',
  'e', 'ku', 'wn'}
function P.admissible(view)
  view = view or {}
  local c = view.c or redis.call('HMGET', config, unpack(view.fields or VIEW_FIELDS))
  view.c = c
  local limit = tonumber(c[1])
  if not limit then return {} end
  if c[7] and tonumber(c[7]) > now then return {} end
  local count = view.count or redis.call('ZCARD', holders)
  view.count = count
  local free = limit - count - (tonumber(c[2]) or 0)
  if free <= 0 then return {} end
  local rates, quotas = P.rates_of(c[4], c[5], c[6], c[9]), P.quotas_of(c[10])
  local first, out, held = nil, {}, nil
  local fair = redis.call('EXISTS', wfair) == 1
  view.fair = fair
  if fair then
    first = {unpack(P.in_order(), 1, free)}
  else
    first = redis.call('ZRANGE', queue, 0, free - 1)
  end
  local costly, more = (tonumber(c[3]) or 0) > 0, (tonumber(c[8]) or 0) > 0
  if (costly or ((rates or quotas) and more)) and #first > 0 then
    -- costs: as many as fit, in order; units: as many as every quota has room for
    local infos = P.each_chunk('HMGET', winfo, first, {})
    local ahead = 0
    for i = 1, #first do
      local units = more and P.units_in(infos[i]) or 1
      free = free - (costly and P.cost_in(infos[i]) or 1)
      if free < 0 then first = {unpack(first, 1, i - 1)} break end
      if i == 1 and P.rates_wait(rates, 0, units) > 0 then return {} end
      if P.quota_wait(quotas, ahead, units) > 0 then first = {unpack(first, 1, i - 1)} break end
      ahead = ahead + units
    end
  elseif (rates or quotas) and #first > 0 then  -- every waiter spends 1 unit
    if P.rates_wait(rates, 0, 1) > 0 then return {} end
    for i = 1, #first do
      if P.quota_wait(quotas, i - 1, 1) > 0 then first = {unpack(first, 1, i - 1)} break end
    end
  end
  -- those whose task another holder holds wait for that twin (htask: one read for them all)
  local fields, tasked = {}, {}
  held = {}
  for i, h in ipairs(first) do
    if P.task_of(h) then
      table.insert(fields, P.task_field(h))
      tasked[i] = #fields
    end
  end
  if #fields > 0 and count > 0 then  -- (nobody holds: no twin)
    P.check_index(count)
    held = P.each_chunk('HMGET', htask, fields, {})
  end
  for i, h in ipairs(first) do
    local twin = tasked[i] and held[tasked[i]]
    if not (twin and P.holds(twin)) then table.insert(out, h) end
  end
  return out
end

-- Every script that changes state starts here: remember which waiters were admissible before
-- anything changes (nil when nobody waits, so the fast path costs one ZCARD), then prune.
-- `view` (optional): admissible()'s, left with what it read of config and the holders' count
-- when the pruning changed neither, for the caller to reuse (and to keep current), and with
-- the number of waiters after the pruning (`waiting`); a caller that read config's
-- VIEW_FIELDS already passes them as its `c`.
function P.begin(view)
  view = view or {}
  local before = nil
  view.waiting = redis.call('ZCARD', queue)
  if view.waiting > 0 then
    before = {}
    for _, h in ipairs(P.admissible(view)) do before[h] = true end
    local wn = tonumber(view.c[14])
    if not wn or wn <= now then
      local gone, next = P.prune_waiters(view.c[1] ~= false)
      view.waiting = view.waiting - gone
      if gone > 0 then view.c, view.count = nil, nil else view.c[14] = next end
    end
  end
  if P.prune_holders(before ~= nil) > 0 then view.c, view.count = nil, nil end
  return before
end

-- (P.push_grant, defined below since it grants, which needs what follows: grants an
-- admissible waiter that asked for pushed grants, and announces the grant on its channel.)

-- ...and ends here: every waiter admissible now that asked for pushed grants (winfo's client
-- field 'client ttl', ttl in us) is granted at once (base.py, "Pushed grants"), and each other
-- waiter this operation made admissible is notified, on the channel of the process that
-- queued it. A waiter queued by this very operation is never admissible, so when nobody waited
-- before (before == nil) there is nobody to wake. With a rate, one grant at most is pushed per
-- operation (each start moves the rate's next one); the others are woken and try. `view`
-- (optional): begin()'s, kept current by the caller since (release.lua).
-- Returns whether it granted anyone.
function P.wake(before, view)
  if not before then return false end
  local pushed_tasks, granted = {}, false
  view = view or {}
  for i, h in ipairs(P.admissible(view)) do
    local info = redis.call('HGET', winfo, h)
    if info then
      local client, pushed = string.match(info, '^([^\n ]*) ?(%d*)')
      local rated = view.c[4] ~= false  -- config's 'ri': a rate
      local task = P.task_of(h)
      -- (two queued deliveries of one task: the second waits for its twin)
      if pushed ~= '' and (i == 1 or not rated) and not (task and pushed_tasks[task]) then
        if task then pushed_tasks[task] = true end
        P.push_grant(h, info, tonumber(pushed), client, view)
        granted = true
      elseif not before[h] then
        redis.call('PUBLISH', channel_prefix .. client, name .. '\n' .. h)
      end
    end
  end
  return granted
end

-- Expiry: a semaphore's keys must outlive its use by idle_ms, but a PEXPIRE on every key of
-- every call costs a fifth of a call's server time. So a key this call created gets its TTL at
-- once, and when config's 'touched' time is older than idle_ms / 16 (or unknown) the call
-- refreshes every key. No key expires while the semaphore is used at least every 15/16 of
-- idle_ms; an idle one is gone within idle_ms. Removing members never needs a TTL: a key keeps
-- its own, and an emptied key is deleted by Redis. `ku` (config's, us; nil: none): config is
-- kept at least until then (a pause, a quota window), even beyond idle_ms.
function P.keep(touched, ku, ...)
  if not touched or now - tonumber(touched) > idle_ms * 1000 / 16 then
    redis.call('HSET', config, 'touched', P.int(now))
    for _, key in ipairs({config, holders, hinfo, queue, wexp, winfo, wfair}) do
      redis.call('PEXPIRE', key, idle_ms)
    end
    ku = tonumber(ku)
    if ku and ku - now > idle_ms * 1000 then
      redis.call('PEXPIRE', config, math.ceil((ku - now) / 1000) + 1000)
    end
    if touched then  -- (an existing config) per-slot epochs an earlier version wrote go
      local most = P.take_slot_epochs()
      if most > 0 and most > (tonumber(redis.call('HGET', config, 'e')) or 0) then
        redis.call('HSET', config, 'e', P.int(most))
      end
    end
  else
    for _, key in ipairs({...}) do redis.call('PEXPIRE', key, idle_ms) end
  end
end

-- An empty semaphore (nobody holds or waits, no pinned limit, not adaptive) keeps its config
-- for EMPTY_MS only (base.py's EMPTY_TTL), or until its rates' next start is due if later, at
-- most idle_ms, and in any case until 'ku' (a pause's end, a quota window's); 'touched' goes,
-- so that the next use gives every key idle_ms again (keep). The other keys are empty, so Redis
-- has deleted them, but wfair, which keeps its TTL, and slots (a string of clear bits once
-- nobody holds: deleted here, or by the caller that passes the holders' `count`).
function P.forget_if_empty(count)
  if count == nil then
    if redis.call('ZCARD', holders) > 0 then return end
    P.drop_index()  -- (its bits all clear: Redis deletes an emptied hash, not a string)
  elseif count > 0 then
    return
  end
  if redis.call('ZCARD', queue) > 0 or redis.call('HGET', config, 'pinned') == '1' then
    return
  end
  local c = redis.call('HMGET', config, 'tat', 'ku', 'ac', 'rn', 'ri', 'rb')
  if c[3] then return end  -- adaptive: its learned limit is kept for idle_ms, as a pinned one
  local ms = EMPTY_MS
  local tat = nil
  for _, r in ipairs(P.rates_of(c[5], c[6], c[1], c[4]) or {}) do tat = math.max(tat or 0, r[3]) end
  if tat then ms = math.max(ms, math.ceil((tat - now) / 1000) + 1000) end
  ms = math.min(ms, idle_ms)
  if c[2] then ms = math.max(ms, math.ceil((tonumber(c[2]) - now) / 1000) + 1000) end
  redis.call('HDEL', config, 'touched')
  redis.call('PEXPIRE', config, ms)
  redis.call('PEXPIRE', wfair, ms)
end

-- Declared limits not seen for idle_ms are forgotten (status also hides them).
function P.prune_declared()
  local fields = redis.call('HGETALL', config)
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 2) == 'd:' and tonumber(fields[i + 1]) < now - idle_ms * 1000 then
      redis.call('HDEL', config, fields[i])
    end
  end
end

-- acquire.lua and acquire_all.lua (model.py's State.place, grant, queue_up) ------------------

-- Take `holder` out of the queue (`xw`, `xu`: config's, nil: read them; `fair`: false when the
-- caller knows that wfair does not exist).
function P.unqueue(holder, xw, xu, fair)
  if not xw then
    local x = redis.call('HMGET', config, 'xw', 'xu')
    xw, xu = tonumber(x[1] or 0), tonumber(x[2] or 0)
  end
  if xw > 0 or (xu or 0) > 0 then
    local info = redis.call('HGET', winfo, holder)
    local cost, units = P.cost_in(info), P.units_in(info)
    if cost > 1 then redis.call('HINCRBY', config, 'xw', 1 - cost) end
    if units > 1 then redis.call('HINCRBY', config, 'xu', 1 - units) end
  end
  redis.call('ZREM', queue, holder)
  redis.call('ZREM', wexp, holder)
  redis.call('HDEL', winfo, holder)
  if fair ~= false then redis.call('HDEL', wfair, holder) end
end

-- The place of a caller that does not hold: its rank in the queue (as queued, or where it
-- would queue), whether it is queued, its fair-share round, the units of the limit the waiters
-- ahead of it need, the units of the rates and quotas they spend, and whether the semaphore is
-- fair (wfair exists). `before` is begin()'s;
-- `tr` the caller's traffic (priority, weight, front) and config's xw and xu.
function P.place(holder, fair_key, before, tr, waiting, lowest)
  local rank, queued, round = 0, false, 0
  if before then
    rank = redis.call('ZRANK', queue, holder)
    queued = rank ~= false
    -- a newcomer ranks behind every waiter of its priority or a higher one (a front one:
    -- behind those of a higher priority and the front ones of its own): behind them all when
    -- none waits at a lower priority than its own (`lowest`: config's 'pl', see queue_up;
    -- `waiting`: begin's count)
    if not queued and waiting and not tr.front and tonumber(lowest)
        and tr.priority <= tonumber(lowest) then
      rank = waiting
    elseif not queued then
      local bound = -tr.priority * PRIO
      if not tr.front then bound = bound + HALF end
      rank = redis.call('ZCOUNT', queue, '-inf', '(' .. P.int(bound))
    end
  end
  -- Fair shares (base.py): a queued waiter keeps its round; a newcomer gets one while fair
  -- (but at the front: round 0).
  local fair = redis.call('EXISTS', wfair) == 1
  if queued then
    if fair then
      round = P.fair_entry(redis.call('HGET', wfair, holder))
      for i, h in ipairs(P.in_order()) do
        if h == holder then rank = i - 1 break end
      end
    end
  elseif (fair or fair_key ~= '') and not tr.front then
    round = P.next_round(fair_key, tr.weight)
    if before then
      rank = 0
      for _, e in ipairs(P.entries()) do
        if e[1] > tr.priority or (e[1] == tr.priority and (e[5] or e[2] <= round)) then
          rank = rank + 1
        end
      end
    end
  end
  local ahead, spend = rank, rank
  if (tr.xw > 0 or (tr.xu > 0 and (tr.rates or tr.quotas))) and rank > 0 then
    -- costs: the units of the waiters ahead; units: what they spend
    local first
    if fair then first = {unpack(P.in_order(), 1, rank)}
    else first = redis.call('ZRANGE', queue, 0, rank - 1) end
    local infos = P.each_chunk('HMGET', winfo, first, {})
    ahead = rank + P.extra_in(infos)
    if tr.xu > 0 then
      for _, info in ipairs(infos) do spend = spend + P.units_in(info) - 1 end
    end
  end
  return rank, queued, round, ahead, spend, fair
end

-- Rates and quotas as a call declares them (traffic()'s ARGV): rates 'interval burst;...' (us)
-- from the first one's two ARGV and the others' one, quotas 'count period offset;...' (us);
-- '-': it declares none (removes them); nil: it declares nothing.
function P.declared_rates(first, burst, more)
  if first == '-' then return {} end
  if not first or first == '' then return nil end
  local rates = {{tonumber(first), tonumber(burst)}}
  for i, b in string.gmatch(more or '', '(%d+) (%d+)') do
    table.insert(rates, {tonumber(i), tonumber(b)})
  end
  return rates
end

-- The traffic options of a call (ARGV from `at`: cost, priority, weight, first rate's interval
-- (us, '' for none, '-' to remove the rates) and burst, units, the other rates, quotas, front
-- ('1'), adaptive (declare()'s)) and config's fields c = {xh, xw, ri, rb, tat, pu, xu, rn, qd,
-- ku} as acquire.lua read them; declared rates and quotas become the semaphore's (base.py,
-- "Rate", "Quotas": a rate keeps the tat of the rate in its place). Returns the table, or nil
-- and the error of units a quota could never admit (then nothing is written).
function P.traffic(at, c)
  local tr = {cost = tonumber(ARGV[at]) or 1, priority = tonumber(ARGV[at + 1]) or 0,
              weight = tonumber(ARGV[at + 2]) or 1, units = tonumber(ARGV[at + 5]) or 1,
              front = ARGV[at + 8] == '1', xh = tonumber(c[1]) or 0,
              xw = tonumber(c[2]) or 0, xu = tonumber(c[7]) or 0, pu = tonumber(c[6]),
              ku = c[10]}
  local rates = P.declared_rates(ARGV[at + 3], ARGV[at + 4], ARGV[at + 6])
  local qd = ARGV[at + 7] or ''
  if qd == '' then qd = c[9] elseif qd == '-' then qd = nil end
  tr.quotas = P.quotas_of(qd)
  for _, q in ipairs(tr.quotas or {}) do
    if tr.units > q[1] then
      return nil, 'UNITS ' .. tr.units .. ' ' .. q[1] .. ' ' .. q[2]
    end
  end
  if (ARGV[at + 7] or '') ~= '' and qd ~= c[9] then
    if qd then redis.call('HSET', config, 'qd', qd) else redis.call('HDEL', config, 'qd') end
  end
  local stored = P.rates_of(c[3], c[4], c[5], c[8])
  if rates then
    local changed = #rates ~= #(stored or {})
    local set, gone = {}, {}
    for i, r in ipairs(rates) do
      local old = (stored or {})[i]
      if not old or old[1] ~= r[1] or old[2] ~= r[2] then
        changed = true
        local k = i == 1 and '' or i
        table.insert(set, 'ri' .. k) table.insert(set, r[1])
        table.insert(set, 'rb' .. k) table.insert(set, r[2])
      end
      r[3] = old and old[3] or 0
    end
    if changed then
      for i = #rates + 1, #(stored or {}) do
        local k = i == 1 and '' or i
        table.insert(gone, 'ri' .. k) table.insert(gone, 'rb' .. k)
        table.insert(gone, 'tat' .. k)
      end
      if #rates > 1 then table.insert(set, 'rn') table.insert(set, #rates)
      else table.insert(gone, 'rn') end
      if #set > 0 then redis.call('HSET', config, unpack(set)) end
      if #gone > 0 then redis.call('HDEL', config, unpack(gone)) end
    end
    if #rates > 0 then tr.rates = rates end
  else
    tr.rates = stored
  end
  return tr
end

-- The verdict for a caller at `rank` needing `ahead` units of the limit before its own and
-- `spend` units of the rates and quotas before its own, with `count` holders: admitted (true),
-- else what it waits for (0 slots, 1 units, 2 rate, 3 pause, 4 quota) and, when time alone can
-- let it start, when (us, else -1).
function P.verdict(tr, count, rank, ahead, limit, twin, spend)
  if tr.pu and tr.pu > now then return false, 3, tr.pu - now end
  local fits = count + tr.xh + ahead + tr.cost <= limit
  if fits and not twin then
    local quota = P.quota_wait(tr.quotas, spend, tr.units)
    local rate = P.rates_wait(tr.rates, spend, tr.units)
    if quota > 0 then return false, 4, math.max(quota, rate) end
    if rate > 0 then return false, 2, rate end
    return true, 0, -1
  end
  if tr.cost > 1 or tr.xh > 0 or ahead > rank then return false, 1, -1 end
  return false, 0, -1
end

-- A config written by a version before config's 'e' kept one 'e:<slot>' epoch per slot used (a
-- hash that Redis keeps as a list, slow to read, up to 512 fields), and such a version still
-- writes them while a rolling upgrade runs: they are deleted, and the greatest returned (0:
-- none).
function P.take_slot_epochs()
  local fields, most, old = redis.call('HGETALL', config), 0, {}
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 2) == 'e:' then
      most = math.max(most, tonumber(fields[i + 1]) or 0)
      table.insert(old, fields[i])
    end
  end
  if #old > 0 then P.each_chunk('HDEL', config, old) end
  return most
end
-- The last fencing epoch this semaphore issued, from config's 'e' as read (`e`; `fresh`: config
-- did not exist before this call). Without 'e', the first grant takes the earlier version's
-- per-slot epochs over (and keep() those written after it, within idle_ms / 16). Epochs
-- increase per semaphore, which is more than per slot (base.py's FencingToken).
function P.issued_epoch(e, fresh)
  if e then return tonumber(e) end
  if fresh then return 0 end
  return P.take_slot_epochs()
end

-- Give `holder` the lowest free `slot` (the semaphore's last epoch: `last_epoch`), leaving the
-- queue; `count` holders held before. Its start spends its units of every rate and quota. `fair`
-- (false: wfair does not exist) and `entry` (its winfo entry, when queued and known) spare
-- reads. Returns the new epoch.
function P.grant(holder, slot, last_epoch, limit, declared_limit, ttl, meta, queued, round,
                     count, touched, tr, fair, entry)
  local epoch = math.max(last_epoch + 1, now)
  if declared_limit then
    redis.call('HSET', config, 'limit', limit, 'd:' .. declared_limit, P.int(now), 'e',
      P.int(epoch))
  else  -- a pushed grant: the waiter declared its limit when it queued
    redis.call('HSET', config, 'e', P.int(epoch))
  end
  if tr.cost > 1 then redis.call('HINCRBY', config, 'xh', tr.cost - 1) end
  if tr.rates then  -- a start: each rate's next one is units * interval later
    local set = {}
    for i, r in ipairs(tr.rates) do
      r[3] = math.max(r[3], now) + tr.units * r[1]
      table.insert(set, i == 1 and 'tat' or 'tat' .. i) table.insert(set, P.int(r[3]))
    end
    redis.call('HSET', config, unpack(set))
  end
  local acct = ''
  if tr.quotas then  -- and adds them to every quota's window, remembered for settle
    local set, ku = {}, tonumber(tr.ku) or 0
    acct = '@' .. tr.units
    for _, q in ipairs(tr.quotas) do
      local key = q[2] .. ':' .. q[3]
      q[6] = q[6] + tr.units
      table.insert(set, 'qs:' .. key) table.insert(set, P.int(q[4]))
      table.insert(set, 'qu:' .. key) table.insert(set, P.int(q[6]))
      ku = math.max(ku, q[5])
      acct = acct .. ';' .. key .. ':' .. P.int(q[4])
    end
    acct = acct .. '\n'
    table.insert(set, 'ku') table.insert(set, P.int(ku))
    redis.call('HSET', config, unpack(set))
    if ku > (tonumber(tr.ku) or 0) and ku - now > idle_ms * 1000 then  -- a long window's first
      redis.call('PEXPIRE', config, math.ceil((ku - now) / 1000) + 1000)
    end
    tr.ku = P.int(ku)
  end
  redis.call('ZADD', holders, P.int(now + ttl), holder)
  P.holders_changed()
  redis.call('HSET', hinfo, holder,
    slot .. '\n' .. P.int(epoch) .. '\n' .. P.int(now) .. '\n' .. acct .. meta)
  if count > 0 then
    P.index_add(holder, slot)
  else  -- the first holder: no index yet (check_index builds it when it is needed)
    index_checked[slots] = nil
  end
  -- the wait: from the caller's first wait (meta), else from its entry in the queue
  local since = tonumber(string.match(meta, '"first_wait":([%d%.]+)') or '')
  if since then since = since * 1000000
  elseif queued then
    since = tonumber(string.match(entry or redis.call('HGET', winfo, holder), '\n(%d+)'))
  else since = now end
  P.observe('wait', now - since)
  if queued then P.unqueue(holder, tr.xw, tr.xu, fair) end
  if round > 0 and round > tonumber(redis.call('HGET', config, 'round') or 0) then
    redis.call('HSET', config, 'round', round)
  end
  if count == 0 then P.keep(touched, tr.ku, holders, hinfo) else P.keep(touched, tr.ku) end
  return epoch
end

-- A pushed grant (wake): waiter `h` (its winfo entry `info`, the lease TTL it asked for, the
-- client id of its process) is admissible: grant it the lowest free slot as acquire.lua would,
-- and publish 'name\nholder\nslot\nepoch\nexpires\nnow\nlimit' on its channel. `view`:
-- admissible()'s, kept current here (the holder this grant adds and the fields of config it
-- writes), so that the next grant of the same wake reads nothing again.
function P.push_grant(h, info, ttl, client, view)
  local slot = P.free_slot(view.count)
  local c = view.c
  local tr = {cost = P.cost_in(info), units = P.units_in(info), xh = tonumber(c[2]) or 0,
              xw = tonumber(c[3]) or 0, xu = tonumber(c[8]) or 0,
              rates = P.rates_of(c[4], c[5], c[6], c[9]), quotas = P.quotas_of(c[10]), ku = c[13]}
  local round = 0
  if view.fair then round = P.fair_entry(redis.call('HGET', wfair, h)) end
  local meta = string.match(info, '^[^\n]*\n[^\n]*\n(.*)$') or '{}'
  local epoch = P.grant(h, slot, P.issued_epoch(c[12], false), tonumber(c[1]), nil, ttl, meta, true,
    round, view.count, c[11], tr, view.fair, info)
  view.count = view.count + 1
  -- config as the grant left it: its epoch, costs held and waiting, the first rate's next start
  -- (the others' are read again by rates_of), 'ku', and 'touched' (now, or fresh already)
  c[12], c[11], c[13] = P.int(epoch), P.int(now), tr.ku
  c[2] = tr.xh + tr.cost - 1
  c[3], c[8] = tr.xw - (tr.cost - 1), tr.xu - (tr.units - 1)
  if tr.rates then c[6] = P.int(tr.rates[1][3]) end
  redis.call('PUBLISH', channel_prefix .. client, name .. '\n' .. h .. '\n' .. slot .. '\n' ..
    P.int(epoch) .. '\n' .. P.int(now + ttl) .. '\n' .. P.int(now) .. '\n' .. c[1])
end

-- Queue `holder` (or refresh its entry) at the place place() found; `wn`: config's (as read:
-- false when absent), lowered to this waiter's expiry if that is earlier. Config's 'pl' (the
-- lowest priority of a waiter: none waits at a lower one while it is there) is set to a
-- newcomer's priority when the queue was empty (`empty`: begin found nobody waiting) or it is
-- lower than 'pl' (`lowest`, as read), so that place() can rank a newcomer behind every waiter
-- without counting them. A 'pl' that is too low (its waiters gone) or absent only costs that
-- count. A version before 'pl' queues without keeping it (a rolling upgrade): a newcomer may
-- then be ranked behind a waiter of a lower priority too, never ahead of one it should follow;
-- it waits where it could have been admitted, and the wake at the end of its own call
-- (acquire.lua) grants or wakes it.
function P.queue_up(holder, queued, round, fair_key, meta, client, waiter_ttl, tr, wn, empty,
                    lowest)
  local set = {}
  if not queued and (empty and tonumber(lowest) ~= tr.priority
      or tonumber(lowest) and tr.priority < tonumber(lowest)) then
    set = {'pl', P.int(tr.priority)}
  end
  if not queued then
    local ticket = redis.call('HINCRBY', config, 'ticket', 1)
    local score = ticket - tr.priority * PRIO
    if tr.front then score = score - HALF end
    redis.call('ZADD', queue, P.int(score), holder)
    if tr.cost > 1 then redis.call('HINCRBY', config, 'xw', tr.cost - 1) end
    if tr.units > 1 then redis.call('HINCRBY', config, 'xu', tr.units - 1) end
    redis.call('HSET', winfo, holder, client .. '\n' .. P.int(now) .. '\n' .. meta)
    if round > 0 then
      redis.call('HSET', wfair, holder, round .. '\n' .. fair_key)
      redis.call('PEXPIRE', wfair, idle_ms)
    end
  end
  redis.call('ZADD', wexp, P.int(now + waiter_ttl), holder)
  if not tonumber(wn) or now + waiter_ttl < tonumber(wn) then
    table.insert(set, 'wn') table.insert(set, P.int(now + waiter_ttl))
  end
  if #set > 0 then redis.call('HSET', config, unpack(set)) end
end

-- Seconds (us) until the earliest lease expires, -1 when nobody holds.
function P.retry_after()
  local first = first_lease[holders] or redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')
  if #first > 0 then return math.max(0, tonumber(first[2]) - now) end
  return -1
end

-- Lua prints 14 significant digits; an adaptive limit's learned value keeps all 17.
function P.real(x) return string.format('%.17g', x) end

-- Limits follow the code (model.py's State.declare, in_force, make_adaptive): the newest
-- declaration (latest process start `stamp`, us, clamped to now; between equal stamps the
-- latest call) is in force unless the limit is pinned, and says whether the limit is adaptive
-- (`adaptive`: 'min max decrease increase', '' for a fixed limit): then the limit in force is
-- floor(current). Returns the limit in force (for a semaphore that does not exist yet, the one
-- the caller's declaration gives it: written by the caller) and the largest cost it can ever
-- admit (an adaptive limit's max). Writes only what changed. A config stored before limits
-- followed the code (no 'ds') keeps its limit pinned when no caller declared it: an upgrade
-- undoes no operator's resize. `cfg` (optional): config's DECLARE_FIELDS, read by the caller.
local DECLARE_FIELDS = {'limit', 'pinned', 'dl', 'ds', 'ac', 'am', 'aM', 'ad', 'ai'}
function P.declare(declared, stamp, adaptive, cfg)
  cfg = cfg or redis.call('HMGET', config, unpack(DECLARE_FIELDS))
  local limit, pinned, wanted, since = tonumber(cfg[1]), cfg[2] == '1', tonumber(cfg[3]),
    tonumber(cfg[4])
  local current = tonumber(cfg[5])
  stamp = math.min(stamp, now)
  if limit and not since and not pinned and redis.call('HEXISTS', config, 'd:' .. limit) == 0 then
    pinned = true
    redis.call('HSET', config, 'pinned', '1')
  end
  if not wanted or stamp >= since then
    local set = {}
    if not wanted or stamp > since or declared ~= wanted then
      wanted, since = declared, stamp
      set = {'dl', wanted, 'ds', P.int(since)}
    end
    local low, high, down, up = string.match(adaptive or '', '^(%S+) (%S+) (%S+) (%S+)$')
    if low then
      low, high = tonumber(low), tonumber(high)
      local was = current
      if not current then current = low else current = math.min(math.max(current, low), high) end
      if current ~= was or low ~= tonumber(cfg[6]) or high ~= tonumber(cfg[7])
          or tonumber(down) ~= tonumber(cfg[8]) or tonumber(up) ~= tonumber(cfg[9]) then
        for _, v in ipairs({'ac', P.real(current), 'am', low, 'aM', high, 'ad', down, 'ai', up}) do
          table.insert(set, v)
        end
      end
      cfg[7] = high
    elseif current then
      current = nil
      redis.call('HDEL', config, 'ac', 'am', 'aM', 'ad', 'ai', 'at', 'ak')
    end
    if #set > 0 then redis.call('HSET', config, unpack(set)) end
  end
  local target = wanted
  if current and not pinned then target = math.floor(current) end
  if not limit then return target, current and tonumber(cfg[7]) or target end
  if not pinned and limit ~= target then
    limit = target
    redis.call('HSET', config, 'limit', limit)
  end
  if current and not pinned then return limit, tonumber(cfg[7]) end
  return limit, limit
end
