-- ARGV[4] holder. Read-only: 1 while the holder's lease is unexpired by the server's clock.
local expires = redis.call('ZSCORE', holders, ARGV[4])
if expires and tonumber(expires) > now then return 1 end
return 0
