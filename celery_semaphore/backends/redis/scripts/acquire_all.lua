-- Several semaphores at once (base.py's Backend.acquire_all, model.py's acquire_all): admitted
-- to all of them in this one script, or holding none of them and, with wait, queued in the
-- first listed one that refuses and in no other.
-- KEYS: the nine keys of each semaphore in turn (so this script never runs on a Redis
-- Cluster, where they hash to different slots: the backend uses the generic protocol there).
-- ARGV[4] holder, [5] ttl (us), [6] meta JSON, [7] wait (0/1), [8] client id,
-- [9] waiter ttl (us), [10] fair-share key ('' for none), [11] n; then for semaphore i:
-- ARGV[10 + 2i] its name, ARGV[11 + 2i] its declared limit; then from ARGV[12 + 2n] the
-- caller's traffic options as acquire.lua's [12] to [21]; the last: the start of the caller's
-- process (us), which dates its declared limits (prelude's declare).
-- Returns {1, now, {slot, epoch, expires, limit} for each} when admitted (or holding all),
-- else {0, index of the refusing semaphore, position (-1: not queued),
-- retry_after (us, -1: nobody holds it), its limit, waits for, rate due (as acquire.lua)}.
local holder, ttl, meta = ARGV[4], tonumber(ARGV[5]), ARGV[6]
local wait, client, waiter_ttl = ARGV[7] == '1', ARGV[8], tonumber(ARGV[9])
local fair_key = ARGV[10] or ''
local n = tonumber(ARGV[11])

-- Point the prelude's per-semaphore locals (its functions' upvalues) at semaphore i.
local function use(i)
  local k = (i - 1) * 9
  config, holders, hinfo, queue, wexp, winfo, wfair, slots, htask =
    KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], KEYS[k + 5], KEYS[k + 6], KEYS[k + 7],
    KEYS[k + 8], KEYS[k + 9]
  name = ARGV[10 + 2 * i]
end

-- A cost some limit could never admit: refused before anything is stored (an adaptive
-- limit's max counts).
local cost = tonumber(ARGV[12 + 2 * n]) or 1
local adaptive = ARGV[12 + 2 * n + 9]
if cost > 1 then
  for i = 1, n do
    use(i)
    local c = redis.call('HMGET', config, 'limit', 'ac', 'aM', 'pinned')
    local limit = tonumber(c[1]) or tonumber(ARGV[11 + 2 * i])
    if c[2] and c[4] ~= '1' then limit = tonumber(c[3]) end
    local high = string.match(adaptive or '', '^%S+ (%S+) ')
    if high and not c[1] then limit = tonumber(high) end
    if cost > limit then return redis.error_reply('COST ' .. cost .. ' ' .. limit) end
  end
end

-- First every semaphore's standing, as acquire.lua finds it, changing nothing but the pruning.
local s = {}
local blocking = nil
for i = 1, n do
  use(i)
  local st = {declared = tonumber(ARGV[11 + 2 * i])}
  local view = {}
  st.before = P.begin(view)
  local twin
  st.count = redis.call('ZCARD', holders)
  st.slot, st.mine, twin = P.read_holders(holder, st.count)
  st.limit = P.declare(st.declared, tonumber(ARGV[#ARGV]), adaptive)
  local cfg = redis.call('HMGET', config, 'touched', 'e', 'xh', 'xw', 'ri', 'rb', 'tat',
    'pu', 'xu', 'rn', 'qd', 'ku', 'wn', 'pl')
  st.touched = cfg[1]
  st.epoch, st.wn, st.lowest = cfg[2], cfg[13], cfg[14]
  local refused
  st.tr, refused = P.traffic(12 + 2 * n, {cfg[3], cfg[4], cfg[5], cfg[6], cfg[7], cfg[8], cfg[9],
    cfg[10], cfg[11], cfg[12]})
  if not st.tr then return redis.error_reply(refused) end
  local rank, queued, round, ahead, spend = P.place(holder, fair_key, st.before, st.tr,
    view.waiting, st.lowest)
  st.rank, st.queued, st.round = rank, queued, round
  local admitted
  admitted, st.waits, st.due = P.verdict(st.tr, st.count, rank, ahead, st.limit, twin, spend)
  st.ok = st.mine ~= nil or admitted
  if not st.ok and not blocking then blocking = i end
  s[i] = st
end

if not blocking then  -- admitted to every one: grant them all
  local out = {1, now}
  for i = 1, n do
    use(i)
    local st = s[i]
    if st.mine then
      local held_slot, epoch = string.match(st.mine, '^(%d+)\n(%d+)\n')
      local expires = tonumber(redis.call('ZSCORE', holders, holder))
      redis.call('HSET', config, 'limit', st.limit, 'd:' .. st.declared, P.int(now))
      P.keep(st.touched, st.tr.ku)
      out[i + 2] = {tonumber(held_slot), tonumber(epoch), expires, st.limit}
    else
      local epoch = P.grant(holder, st.slot, P.issued_epoch(st.epoch, false), st.limit, st.declared,
        ttl, meta, st.queued, st.round, st.count, st.touched, st.tr)
      out[i + 2] = {st.slot, epoch, now + ttl, st.limit}
    end
    P.wake(st.before)
  end
  return out
end

-- Refused: hold none of them (a lease of the set held alone is given back), and wait in the
-- refusing semaphore's queue only.
local position, retry = -1, -1
for i = 1, n do
  use(i)
  local st = s[i]
  redis.call('HSET', config, 'limit', st.limit, 'd:' .. st.declared, P.int(now))
  if st.mine then
    redis.call('ZREM', holders, holder)
    P.holders_changed()
    redis.call('HDEL', hinfo, holder)
    P.index_remove(holder, st.mine)
    if P.cost_in(st.mine) > 1 then redis.call('HINCRBY', config, 'xh', 1 - P.cost_in(st.mine)) end
    P.observe('hold', now - tonumber(string.match(st.mine, '^%d+\n%d+\n(%d+)')))
  end
  if i == blocking then
    if wait then
      P.queue_up(holder, st.queued, st.round, fair_key, meta, client, waiter_ttl, st.tr, st.wn,
        st.before == nil, st.lowest)
      position = st.rank
    end
    if wait and not st.queued and st.rank == 0 then
      P.keep(st.touched, st.tr.ku, queue, wexp, winfo)
    else
      P.keep(st.touched, st.tr.ku)
    end
    retry = P.retry_after()
  else
    if wait and st.queued then  -- waits elsewhere now: out of this queue
      P.unqueue(holder, st.tr.xw, st.tr.xu)
    end
    P.keep(st.touched, st.tr.ku)
  end
  P.wake(st.before)
end
return {0, blocking, position, retry, s[blocking].limit, s[blocking].waits, s[blocking].due}
