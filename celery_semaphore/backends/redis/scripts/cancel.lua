-- ARGV[4] holder: leave the waiter queue (nothing to do when nobody waits).
local before = begin()
if before then
  redis.call('ZREM', queue, ARGV[4])
  redis.call('ZREM', wexp, ARGV[4])
  redis.call('HDEL', winfo, ARGV[4])
  redis.call('HDEL', wfair, ARGV[4])
end
wake(before)
return 0
