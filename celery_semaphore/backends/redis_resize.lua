-- ARGV[4] limit. Returns 1 when the semaphore was created by this call.
local before = admissible()
prune()
local created = 1 - redis.call('EXISTS', cfg)
redis.call('HSET', cfg, 'limit', tonumber(ARGV[4]))
prune_declared()
touch(declared)
wake(before)
return created
