-- A request ended: its reservation is let go (once: settling twice changes nothing), its cost is
-- spent, and the completion tokens of a request that gave no `max_tokens` are charged to `tpm`
-- (below zero if need be, as in process: at most a day's tokens of debt).
-- KEYS: 1 the month's spend, 2 reservations, 3 reservation amounts, 4 the reservations' total,
--       5 tpm bucket
-- ARGV: 1 request id, 2 usd, 3 completion tokens, 4 tpm (0: none), 5 the spend's lifetime (s)
-- Returns the month's spend (text).
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  local a = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0') or 0
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('INCRBYFLOAT', KEYS[4], -a)
end
local usd = tonumber(ARGV[2])
if usd > 0 then
  redis.call('HINCRBYFLOAT', KEYS[1], 'usd', ARGV[2])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
end
local n, tpm = tonumber(ARGV[3]), tonumber(ARGV[4])
if n > 0 and tpm > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local v = redis.call('HMGET', KEYS[5], 'l', 't')
  local l, at = tonumber(v[1]), tonumber(v[2])
  if l == nil or at == nil then
    l = tpm
  else
    l = math.min(tpm, l + math.max(0, now - at) * tpm / 60000)
  end
  l = math.max(l - n, -tpm * 1440)
  redis.call('HSET', KEYS[5], 'l', tostring(l), 't', now)
  redis.call('PEXPIRE', KEYS[5], math.ceil((tpm - l) * 60000 / tpm) + 1000)
end
return tostring(tonumber(redis.call('HGET', KEYS[1], 'usd') or '0') or 0)
