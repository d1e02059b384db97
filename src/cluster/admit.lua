-- One request's admission for a client key, atomically for the whole fleet: the budget (what is
-- spent this month plus what running requests reserved), then `rpm`, then `tpm`; nothing is
-- taken unless everything passes. Buckets hold a minute's worth and refill continuously (the
-- in-process limits' rule), on Redis's own clock so the replicas' clocks do not matter.
-- KEYS: 1 rpm bucket, 2 tpm bucket, 3 the month's spend, 4 reservations (id -> expiry),
--       5 reservation amounts (id -> usd), 6 the reservations' total
-- ARGV: 1 rpm (0: none), 2 tpm (0: none), 3 tokens, 4 budget (-1: none), 5 reservation usd,
--       6 request id, 7 how long a reservation is held at most (ms)
-- Returns {verdict, usd spent (text), retry after ms, reset ms, remaining (text)}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local budget, reserve = tonumber(ARGV[4]), tonumber(ARGV[5])
local usd = tonumber(redis.call('HGET', KEYS[3], 'usd') or '0') or 0
if budget >= 0 then
  local expired = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
  for _, id in ipairs(expired) do
    local a = tonumber(redis.call('HGET', KEYS[5], id) or '0') or 0
    redis.call('HDEL', KEYS[5], id)
    redis.call('INCRBYFLOAT', KEYS[6], -a)
  end
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  end
  local reserved = math.max(0, tonumber(redis.call('GET', KEYS[6]) or '0') or 0)
  if usd + reserved >= budget then
    return {'budget', tostring(usd), 0, 0, '0'}
  end
end
local function level(key, cap)
  local v = redis.call('HMGET', key, 'l', 't')
  local l, at = tonumber(v[1]), tonumber(v[2])
  if l == nil or at == nil then
    return cap
  end
  return math.min(cap, l + math.max(0, now - at) * cap / 60000)
end
local function ms(n)
  return math.max(0, math.ceil(n))
end
local rl, tl
if rpm > 0 then
  rl = level(KEYS[1], rpm)
  if rl < 1 then
    return {'requests', tostring(usd), ms((1 - rl) * 60000 / rpm), ms((rpm - rl) * 60000 / rpm), '0'}
  end
end
if tpm > 0 and tokens > 0 then
  tl = level(KEYS[2], tpm)
  local left = tostring(math.max(0, math.floor(tl)))
  if tokens > tpm then
    return {'tokens', tostring(usd), 60000, ms((tpm - tl) * 60000 / tpm), left}
  end
  if tokens > tl then
    return {'tokens', tostring(usd), ms((tokens - tl) * 60000 / tpm), ms((tpm - tl) * 60000 / tpm), left}
  end
end
local function put(key, cap, l)
  redis.call('HSET', key, 'l', tostring(l), 't', now)
  -- Gone once it would be full again: a missing bucket reads as full.
  redis.call('PEXPIRE', key, ms((cap - l) * 60000 / cap) + 1000)
end
if rl then
  put(KEYS[1], rpm, rl - 1)
end
if tl then
  put(KEYS[2], tpm, tl - tokens)
end
if budget >= 0 and reserve > 0 then
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[7]), ARGV[6])
  redis.call('HSET', KEYS[5], ARGV[6], tostring(reserve))
  redis.call('INCRBYFLOAT', KEYS[6], reserve)
end
return {'ok', tostring(usd), 0, 0, '0'}
