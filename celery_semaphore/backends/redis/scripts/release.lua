-- ARGV[4] holder, [5] the outcome of its call ('ok', 'overload', 'error'; absent or '': none),
-- [6] its latency (us; kept for a later rule). Returns 1 when the holder held an unexpired
-- lease, else 0. An outcome moves an adaptive limit (model.py's State.adapt) in this step.
-- `view`: what begin read of config (this script's fields too) and the holders' count when
-- somebody waits, kept current below for the wake (which then reads neither again).
local view = {fields = {'limit', 'xh', 'xw', 'ri', 'rb', 'tat', 'pu', 'xu', 'rn', 'qd', 'touched',
  'e', 'ku', 'wn', 'ac', 'am', 'aM', 'ad', 'ai', 'at', 'pinned', 'ak'}}
local before = P.begin(view)
local removed = redis.call('ZREM', holders, ARGV[4])
P.holders_changed()
local left = nil  -- the holders' count after this release, when it released
if removed == 1 then
  if view.count then left = view.count - 1 else left = redis.call('ZCARD', holders) end
  view.count = left
  local info = redis.call('HGET', hinfo, ARGV[4])
  redis.call('HDEL', hinfo, ARGV[4])
  if left == 0 then P.drop_index()  -- the last holder: no index left
  elseif info then P.index_remove(ARGV[4], info) end
  -- config's limit: its presence says that config exists (every script that creates config
  -- gives it one); then the adaptive limit's fields
  local c = nil
  if info and view.c then
    local v = view.c
    c = {v[1], v[15], v[16], v[17], v[18], v[19], v[20], v[21], v[2], v[22]}
  elseif info then
    c = redis.call('HMGET', config, 'limit', 'ac', 'am', 'aM', 'ad', 'ai', 'at', 'pinned', 'xh',
      'ak')
  end
  if info and c[1] then
    table.remove(c, 1)
    local since = tonumber(string.match(info, '^%d+\n%d+\n(%d+)'))
    P.observe('hold', now - since)
    local xh = tonumber(c[8]) or 0  -- after this release
    if P.cost_in(info) > 1 then
      redis.call('HINCRBY', config, 'xh', 1 - P.cost_in(info))
      xh = xh + 1 - P.cost_in(info)
      if view.c then view.c[2] = xh end
    end
    local outcome = ARGV[5] or ''
    if outcome == 'ok' or outcome == 'overload' then
      local current = tonumber(c[1])
      if current and c[7] ~= '1' then
        local set = {}
        local ceiling = tonumber(c[9]) or 0
        if outcome == 'ok' then
          -- the units held before this release, its own included
          local held = left + xh + P.cost_in(info)
          if held >= current / 2 then
            local step = tonumber(c[5]) / current
            -- probing the limit that last overloaded: base.ADAPTIVE_PROBE_SLOWER times slower
            if ceiling > 0 and math.floor(current) + 1 >= ceiling then step = step / 32 end
            current = math.min(tonumber(c[3]), current + step)
            if ceiling > 0 and math.floor(current) > ceiling then  -- it held: forgotten
              redis.call('HDEL', config, 'ak')
            end
          end
        elseif since >= (tonumber(c[6]) or 0) then  -- once per round trip of work
          set = {'at', P.int(now), 'ak', math.floor(current)}
          current = math.max(tonumber(c[2]), current * tonumber(c[4]))
        end
        table.insert(set, 'ac') table.insert(set, P.real(current))
        table.insert(set, 'limit') table.insert(set, math.floor(current))
        redis.call('HSET', config, unpack(set))
        if view.c then view.c[1] = math.floor(current) end
      end
    end
  end
end
-- (a grant the wake pushed holds: the semaphore is not empty)
if not P.wake(before, view) then P.forget_if_empty(left) end
return removed
