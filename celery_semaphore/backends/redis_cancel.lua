-- ARGV[4] holder: leave the waiter queue.
local before = admissible()
prune()
redis.call('ZREM', queue, ARGV[4])
redis.call('ZREM', wexp, ARGV[4])
redis.call('HDEL', winfo, ARGV[4])
wake(before)
return 0
