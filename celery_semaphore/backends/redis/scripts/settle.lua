-- ARGV[4] holder, [5] units it actually spent (base.py, "Settling"): adjust, by the difference
-- from what was counted so far, every quota window its admission counted in that has not
-- turned (never below 0) and every rate's tat (a refund never before now; an overdraft from
-- max(tat, now)); its hinfo entry then says what is counted ('@counted;p:o:start;...' before
-- its meta). Returns 1 when the holder holds (also when nothing changed), else 0.
local before = P.begin()
local holder, units = ARGV[4], tonumber(ARGV[5])
local info = redis.call('HGET', hinfo, holder)
if not info then
  P.wake(before)
  return 0
end
local head, rest = string.match(info, '^(%d+\n%d+\n%d+\n)(.*)$')
local acct, meta = string.match(rest, '^@([^\n]*)\n(.*)$')
if not acct then acct, meta = '', rest end
local counted = tonumber(string.match(acct, '^(%d+)')) or P.units_in('\n' .. meta)
local change = units - counted
if change ~= 0 then
  local windows = {}
  for p, o, start in string.gmatch(acct, ';(%d+):(%-?%d+):(%-?%d+)') do
    table.insert(windows, {p, o, tonumber(start)})
  end
  for _, w in ipairs(windows) do  -- its window, unless it turned
    local key = w[1] .. ':' .. w[2]
    local c = redis.call('HMGET', config, 'qs:' .. key, 'qu:' .. key)
    if tonumber(c[1]) == w[3] and P.window_of(tonumber(w[1]), tonumber(w[2])) == w[3] then
      redis.call('HSET', config, 'qu:' .. key, P.int(math.max(0, (tonumber(c[2]) or 0) + change)))
    end
  end
  local c = redis.call('HMGET', config, 'ri', 'rb', 'tat', 'rn')
  local rates = P.rates_of(c[1], c[2], c[3], c[4])
  if rates then
    local set = {}
    for i, r in ipairs(rates) do
      local tat
      if change < 0 then tat = math.max(now, r[3] + change * r[1])
      else tat = math.max(r[3], now) + change * r[1] end
      table.insert(set, i == 1 and 'tat' or 'tat' .. i) table.insert(set, P.int(tat))
    end
    redis.call('HSET', config, unpack(set))
  end
  acct = units .. (string.match(acct, '^%d*(.*)$') or '')
  redis.call('HSET', hinfo, holder, head .. '@' .. acct .. '\n' .. meta)
end
P.wake(before)
return 1
