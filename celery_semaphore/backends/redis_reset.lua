-- Delete every key of the semaphore. Returns 1 when it existed. Epochs restart from the
-- server's clock, so fencing tokens still increase.
local existed = redis.call('EXISTS', cfg)
redis.call('DEL', cfg, holders, hinfo, queue, wexp, winfo, epochs, declared)
return existed
