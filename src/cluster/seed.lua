-- A replica's own record of a key's month (its SQLite trail) raises the shared one, never lowers
-- it: after the store restarted empty, the fleet's spend is rebuilt from what the replicas know.
-- KEYS: 1 the month's spend. ARGV: 1 usd, 2 the spend's lifetime (s).
local cur = tonumber(redis.call('HGET', KEYS[1], 'usd') or '0') or 0
if tonumber(ARGV[1]) > cur then
  redis.call('HSET', KEYS[1], 'usd', ARGV[1])
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
