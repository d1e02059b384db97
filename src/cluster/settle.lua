-- Requests ended: for each, its reservation is let go (once: settling twice changes nothing),
-- its cost is spent, and the completion tokens of a request that gave no `max_tokens` are
-- charged to `tpm` (below zero if need be, as in process: at most a day's tokens of debt).
-- Several settles go in one call (the settler sends what queued while the last call ran).
-- KEYS: five a settle: 1 the month's spend, 2 reservations, 3 reservation amounts, 4 the
--       reservations' total, 5 tpm bucket
-- ARGV: 1 the spend's lifetime (s), then four a settle: request id, usd, completion tokens,
--       tpm (0: none)
-- Returns how many were settled.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local n = math.floor(#KEYS / 5)
for i = 0, n - 1 do
  local k, a = i * 5, 1 + i * 4
  local id, usd = ARGV[a + 1], tonumber(ARGV[a + 2])
  local tokens, tpm = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  if id ~= '' and redis.call('ZREM', KEYS[k + 2], id) == 1 then
    local held = tonumber(redis.call('HGET', KEYS[k + 3], id) or '0') or 0
    redis.call('HDEL', KEYS[k + 3], id)
    redis.call('INCRBYFLOAT', KEYS[k + 4], -held)
  end
  if usd > 0 then
    redis.call('HINCRBYFLOAT', KEYS[k + 1], 'usd', ARGV[a + 2])
    redis.call('EXPIRE', KEYS[k + 1], ttl)
  end
  if tokens > 0 and tpm > 0 then
    local v = redis.call('HMGET', KEYS[k + 5], 'l', 't')
    local l, at = tonumber(v[1]), tonumber(v[2])
    if l == nil or at == nil then
      l = tpm
    else
      l = math.min(tpm, l + math.max(0, now - at) * tpm / 60000)
    end
    l = math.max(l - tokens, -tpm * 1440)
    redis.call('HSET', KEYS[k + 5], 'l', tostring(l), 't', now)
    redis.call('PEXPIRE', KEYS[k + 5], math.ceil((tpm - l) * 60000 / tpm) + 1000)
  end
end
return n
