-- A replica says it is alive for ARGV[2] ms; returns how many replicas are, and the store's
-- epoch: set by the first replica to find the store empty of the fleet's state (new, or
-- restarted empty), so every replica sees it change and seeds the store again.
-- KEYS: 1 the replicas (id -> until), 2 the epoch. ARGV: 1 this replica's id, 2 ms, 3 a new
-- epoch, used if none is set.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', KEYS[2], ARGV[3], 'NX')
local epoch = redis.call('GET', KEYS[2])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return {redis.call('ZCARD', KEYS[1]), epoch}
