-- Delete every key of the semaphore; holders lose their leases and nobody is woken. Returns 1
-- when it existed. Epochs go with config and restart from the server's clock (microseconds),
-- so fencing tokens still increase.
local existed = redis.call('EXISTS', config)
redis.call('DEL', config, holders, hinfo, queue, wexp, winfo, wfair, slots, htask)
return existed
