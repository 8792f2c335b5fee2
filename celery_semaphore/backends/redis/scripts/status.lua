-- Read-only snapshot (waiters in admission order), hiding what pruning would remove: {now, limit, declared [limit, seen]...,
-- holders [holder, expiry, info]..., waiters [holder, ticket, info]..., counters,
-- pinned (0/1), newest declared limit (-1: none)}, or false when the semaphore is unknown.
local fields = redis.call('HGETALL', config)
local limit = nil
local declared_list = {}
local pinned, wanted, since, seen = 0, -1, nil, {}
for i = 1, #fields, 2 do
  if string.sub(fields[i], 1, 2) == 'd:' then seen[string.sub(fields[i], 3)] = true end
  if fields[i] == 'pinned' then pinned = 1
  elseif fields[i] == 'dl' then wanted = tonumber(fields[i + 1])
  elseif fields[i] == 'ds' then since = fields[i + 1] end
  if fields[i] == 'limit' then
    limit = fields[i + 1]
  elseif string.sub(fields[i], 1, 2) == 'd:' and tonumber(fields[i + 1]) >= now - idle_ms * 1000 then
    table.insert(declared_list, string.sub(fields[i], 3))
    table.insert(declared_list, fields[i + 1])
  end
end
if not limit then return false end
-- stored before limits followed the code: pinned unless a caller declared its limit (declare)
if not since and not seen[limit] then pinned = 1 end

local holder_list = {}
local live = redis.call('ZRANGEBYSCORE', holders, '(' .. P.int(now), '+inf', 'WITHSCORES')
local names = {}
for i = 1, #live, 2 do table.insert(names, live[i]) end
local infos = P.each_chunk('HMGET', hinfo, names, {})
for i, h in ipairs(names) do
  table.insert(holder_list, h)
  table.insert(holder_list, live[2 * i])
  table.insert(holder_list, infos[i] or '')
end

local waiter_list = {}
names = P.in_order()
local tickets = P.each_chunk('ZMSCORE', queue, names, {})
local expiries = P.each_chunk('ZMSCORE', wexp, names, {})
infos = P.each_chunk('HMGET', winfo, names, {})
for i, h in ipairs(names) do
  if tonumber(expiries[i] or 0) > now then
    table.insert(waiter_list, h)
    table.insert(waiter_list, tickets[i])
    table.insert(waiter_list, infos[i] or '')
  end
end
-- counters: the 's:' fields of config, with the leases expired but not pruned yet
local stat_list = {}
local expired = redis.call('ZCOUNT', holders, '-inf', P.int(now))
for i = 1, #fields, 2 do
  if string.sub(fields[i], 1, 2) == 's:' then
    local value = fields[i + 1]
    if fields[i] == 's:expired' then value = P.int(tonumber(value) + expired); expired = 0 end
    table.insert(stat_list, string.sub(fields[i], 3))
    table.insert(stat_list, value)
  end
end
if expired > 0 then
  table.insert(stat_list, 'expired')
  table.insert(stat_list, P.int(expired))
end
-- the first rate: {interval us, burst, tat us}, '' for each without one
local f = {}
for i = 1, #fields, 2 do f[fields[i]] = fields[i + 1] end
local rate = {f['ri'] or '', f['rb'] or '', f['tat'] or ''}
-- then {paused until (us, '' when not paused), reason, every rate {interval, burst, tat}...,
-- every quota {count, period, offset, window start, window end, used}..., the adaptive limit
-- {min, max, current} or {}}
local paused, reason = '', ''
if f['pu'] and tonumber(f['pu']) > now then paused, reason = f['pu'], f['pr'] or '' end
local rates = {}
if f['ri'] then
  for i = 1, tonumber(f['rn'] or 1) do
    local k = i == 1 and '' or i
    table.insert(rates, f['ri' .. k]) table.insert(rates, f['rb' .. k])
    table.insert(rates, f['tat' .. k] or '0')
  end
end
local quotas = {}
for c, p, o in string.gmatch(f['qd'] or '', '(%d+) (%d+) (%-?%d+)') do
  local start, finish = P.window_of(tonumber(p), tonumber(o))
  local used = '0'
  if tonumber(f['qs:' .. p .. ':' .. o]) == start then used = f['qu:' .. p .. ':' .. o] or '0' end
  for _, v in ipairs({c, p, o, P.int(start), P.int(finish), used}) do table.insert(quotas, v) end
end
local adaptive = {}
if f['ac'] then adaptive = {f['am'], f['aM'], f['ac']} end
return {P.int(now), limit, declared_list, holder_list, waiter_list, stat_list, pinned, wanted,
  rate, {paused, reason, rates, quotas, adaptive}}
