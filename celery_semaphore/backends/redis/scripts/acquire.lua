-- ARGV[4] holder, [5] declared limit, [6] ttl (us), [7] meta JSON, [8] wait (0/1),
-- [9] client id, [10] waiter ttl (us), [11] fair-share key ('' for none), [12] cost, [13] priority,
-- [14] fair weight, [15] rate interval (us, '' for none, '-': no rates), [16] burst, [17] units,
-- [18] the other rates, [19] quotas, [20] front, [21] adaptive limit (prelude's traffic() and
-- declare()); the last: the start of the caller's process (us), which dates its declared limit
-- (prelude's declare).
-- Returns {1, slot, epoch, expires, now, limit[, units still free nobody waits for]} when
-- admitted (or already holding), else
-- {0, position (-1: not queued), retry_after (us, -1: nobody holds), now, limit,
-- waits for (0 slots, 1 units, 2 rate, 3 pause, 4 quota), due (us, -1: time alone cannot
-- admit it)}.
local holder, declared_limit, ttl = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local meta, wait, client, waiter_ttl = ARGV[7], ARGV[8] == '1', ARGV[9], tonumber(ARGV[10])
local fair_key = ARGV[11] or ''

-- One read of config, before anything changes: the prelude's VIEW_FIELDS first (begin takes
-- them as they are: config is read again only if the pruning changed it), then what declare()
-- needs besides (declare writes none of the others), then when this declared limit was last
-- seen. begin leaves the holders' count it read when somebody waits.
local function read_config()
  return redis.call('HMGET', config, 'limit', 'xh', 'xw', 'ri', 'rb', 'tat', 'pu', 'xu', 'rn',
    'qd', 'touched', 'e', 'ku', 'wn', 'pinned', 'dl', 'ds', 'ac', 'am', 'aM', 'ad', 'ai',
    'd:' .. declared_limit, 'pl')
end
local all = read_config()
local view = {c = all}
local before = P.begin(view)
all = view.c or read_config()  -- (view.c: all, its 'wn' kept current by the pruning)

-- The holders' count, the re-acquire check, the lowest free slot and any twin (another
-- holder of this holder's task: while it holds, this one is not admitted), from their index;
-- with at least as many holders as the caller's declared limit (most likely full: a queue
-- entry) only the count and the re-acquire check, the rest read if it is admitted after all
-- (slot nil: not read yet).
local count = view.count or redis.call('ZCARD', holders)
local slot, mine, twin
if count < declared_limit then
  slot, mine, twin = P.read_holders(holder, count)
else
  mine = redis.call('HGET', hinfo, holder)
end

-- The limit in force (the newest declaration's unless pinned); a new semaphore's is ours.
local limit, ceiling = P.declare(declared_limit, tonumber(ARGV[#ARGV]), ARGV[21],
  {all[1], all[15], all[16], all[17], all[18], all[19], all[20], all[21], all[22]})
local touched = all[11]
-- a cost the limit could never admit: refused before anything but the declaration is stored
if (tonumber(ARGV[12]) or 1) > ceiling then
  return redis.error_reply('COST ' .. ARGV[12] .. ' ' .. ceiling)
end
local tr, refused = P.traffic(12, {all[2], all[3], all[4], all[5], all[6], all[7], all[8], all[9],
  all[10], all[13]})
if not tr then return redis.error_reply(refused) end

if mine then  -- a current holder gets its grant back unchanged
  local held_slot, epoch = string.match(mine, '^(%d+)\n(%d+)\n')
  local expires = tonumber(redis.call('ZSCORE', holders, holder))
  -- the limit too: a config that expired on its own must not come back without one
  redis.call('HSET', config, 'limit', limit, 'd:' .. declared_limit, P.int(now))
  P.keep(touched, tr.ku)
  P.wake(before)
  return {1, tonumber(held_slot), tonumber(epoch), expires, now, limit}
end

local rank, queued, round, ahead, spend, fair = P.place(holder, fair_key, before, tr,
  view.waiting, all[24])
local admitted, waits, due = P.verdict(tr, count, rank, ahead, limit, twin or false, spend)
if admitted and not slot then  -- read now: the twin, then the slot
  twin = P.read_twin(holder, count)
  if twin then
    admitted, waits, due = P.verdict(tr, count, rank, ahead, limit, twin, spend)
  else
    slot = P.free_slot(count)
  end
end

if admitted then
  -- count < limit, so the lowest free slot is below the limit.
  local epoch = P.grant(holder, slot, P.issued_epoch(all[12], not all[1]), limit, declared_limit,
    ttl, meta, queued, round, count, touched, tr, fair)
  P.wake(before)
  -- the units still free that nobody waits for: a hint for callers that take slots ahead (the
  -- queue was empty when this call began, before == nil, and it queued nobody)
  local waiting = 0
  if before then waiting = redis.call('ZCARD', queue) end
  local free = limit - count - 1 - tr.xh - (tr.cost - 1) - waiting
  return {1, slot, epoch, now + ttl, now, limit, free}
end

-- The declaration is dated (the limit too: a config that expired on its own must not come back
-- without one), unless config has a limit and dated it less than a second ago: status says
-- when each declared limit was last seen to within a second.
if not all[1] or not all[23] or now - tonumber(all[23]) > 1000000 then
  redis.call('HSET', config, 'limit', limit, 'd:' .. declared_limit, P.int(now))
end
local position = -1
if wait then
  P.queue_up(holder, queued, round, fair_key, meta, client, waiter_ttl, tr, all[14],
    before == nil, all[24])
  position = rank
end
-- A waiter added to an empty queue created the queue's keys.
if wait and not queued and rank == 0 then
  P.keep(touched, tr.ku, queue, wexp, winfo)
else
  P.keep(touched, tr.ku)
end
local retry = P.retry_after()
-- Nobody can be admitted while the units held fill the limit (admissible()'s first test; this
-- call changed neither), so the wake is spared then.
if limit - count - tr.xh > 0 then P.wake(before) end
return {0, position, retry, now, limit, waits, due}
