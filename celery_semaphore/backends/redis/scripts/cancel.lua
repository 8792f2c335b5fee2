-- ARGV[4] holder: leave the waiter queue (nothing to do when nobody waits).
local before = P.begin()
if before then
  P.unqueue(ARGV[4], nil)
end
P.wake(before)
P.forget_if_empty()
return 0
