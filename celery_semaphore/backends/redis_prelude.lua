-- Shared by every script. KEYS: the eight keys of one semaphore, all under one hash tag.
-- ARGV[1]: idle TTL (ms), ARGV[2]: wake channel prefix, ARGV[3]: semaphore name.
-- Time is the server's, in microseconds; scores of holders and waiters are absolute expiries.
local cfg, holders, hinfo, queue, wexp, winfo, epochs, declared =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local idle_ms, channel_prefix, name = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

-- Numbers passed to redis.call are formatted with 14 digits; microsecond times need 16.
local function int(x) return string.format('%d', x) end

local function remove_all(key, members, command)
  for i = 1, #members, 500 do
    redis.call(command, key, unpack(members, i, math.min(i + 499, #members)))
  end
end

-- The waiters the FIFO rule admits now: the first (limit - holders) of the queue.
local function admissible()
  local set = {}
  if redis.call('EXISTS', queue) == 0 then return set end
  local limit = tonumber(redis.call('HGET', cfg, 'limit'))
  if limit then
    local free = limit - redis.call('ZCARD', holders)
    if free > 0 then
      for _, h in ipairs(redis.call('ZRANGE', queue, 0, free - 1)) do set[h] = true end
    end
  end
  return set
end

local function prune()
  local dead = redis.call('ZRANGEBYSCORE', holders, '-inf', int(now))
  if #dead > 0 then
    remove_all(holders, dead, 'ZREM')
    remove_all(hinfo, dead, 'HDEL')
  end
  local gone = redis.call('ZRANGEBYSCORE', wexp, '-inf', int(now))
  if #gone > 0 then
    remove_all(wexp, gone, 'ZREM')
    remove_all(queue, gone, 'ZREM')
    remove_all(winfo, gone, 'HDEL')
  end
end

-- Declared limits not seen for idle_ms are forgotten (run where limits change, not per acquire).
local function prune_declared()
  local seen = redis.call('HGETALL', declared)
  for i = 1, #seen, 2 do
    if tonumber(seen[i + 1]) < now - idle_ms * 1000 then redis.call('HDEL', declared, seen[i]) end
  end
end

-- Notify the waiters this operation made admissible, on their process's channel.
local function wake(before)
  if redis.call('EXISTS', queue) == 0 then return end
  for h in pairs(admissible()) do
    if not before[h] then
      local info = redis.call('HGET', winfo, h)
      if info then
        local client = string.match(info, '^[^\n]*')
        redis.call('PUBLISH', channel_prefix .. client, name .. '\n' .. h)
      end
    end
  end
end

-- Keep written keys (and the limit) for idle_ms after their last write. A key Redis dropped
-- when it emptied comes back without a TTL, so every write sets it again.
local function touch(...)
  redis.call('PEXPIRE', cfg, idle_ms)
  for _, key in ipairs({...}) do redis.call('PEXPIRE', key, idle_ms) end
end
