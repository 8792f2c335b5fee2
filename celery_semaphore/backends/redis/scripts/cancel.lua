-- ARGV[4] holder: leave the waiter queue (nothing to do when nobody waits).
local before = begin()
if before then
  unqueue(ARGV[4], nil)
end
wake(before)
forget_if_empty()
return 0
