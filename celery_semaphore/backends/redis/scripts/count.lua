-- ARGV[4..] counter, n pairs: add worker-side counts (requeued, parked_worker, parked_send) to
-- the semaphore's counters. Nothing when the semaphore is unknown. Returns 1 when counted.
if redis.call('EXISTS', config) == 0 then return 0 end
for i = 4, #ARGV, 2 do
  local field = ARGV[i]
  if field == 'requeued' or field == 'parked_worker' or field == 'parked_send' then
    P.stat(field, tonumber(ARGV[i + 1]))
  end
end
return 1
