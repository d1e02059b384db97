-- A replica says it is alive for ARGV[2] ms; returns how many replicas are, and 1 when the store
-- holds none of the fleet's state yet (new, or restarted empty: the replicas then seed it).
-- KEYS: 1 the replicas (id -> until), 2 the fleet's marker. ARGV: 1 this replica's id, 2 ms.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local fresh = redis.call('SET', KEYS[2], '1', 'NX') and 1 or 0
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return {redis.call('ZCARD', KEYS[1]), fresh}
