-- Requests ended: for each, its reservation is let go (once: settling twice changes nothing),
-- its cost is spent, and the completion tokens of a request that gave no `max_tokens` are
-- charged to `tpm` (below zero if need be, as in process: at most a day's tokens of debt).
-- Each settle has a name; the store remembers the names it applied (for ARGV[2] ms), and one
-- sent again (its last call timed out but ran) spends and charges nothing twice.
-- Several settles go in one call (the settler sends what queued while the last call ran).
-- KEYS: six a settle: 1 the month's spend, 2 reservations, 3 reservation amounts, 4 the
--       reservations' total, 5 tpm bucket, 6 the names applied (name -> when)
-- ARGV: 1 the spend's lifetime (s), 2 how long names are remembered (ms), then five a settle:
--       its name, the reservation ('': none), usd, completion tokens, tpm (0: none)
-- Returns how many were settled.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl, keep = tonumber(ARGV[1]), tonumber(ARGV[2])
-- The names a key keeps at most (the newest): a key without `rpm`, fast enough, cannot fill the
-- shared store with them; one resent after more than this many of its key's settles since
-- would be applied again (its own key's bill, never another's).
local most = 100000
local n = math.floor(#KEYS / 6)
local pruned = {}
for i = 0, n - 1 do
  local k, a = i * 6, 2 + i * 5
  local name, id, usd = ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3])
  local tokens, tpm = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  if id ~= '' and redis.call('ZREM', KEYS[k + 2], id) == 1 then
    local held = tonumber(redis.call('HGET', KEYS[k + 3], id) or '0') or 0
    redis.call('HDEL', KEYS[k + 3], id)
    redis.call('INCRBYFLOAT', KEYS[k + 4], -held)
  end
  local done = KEYS[k + 6]
  if not pruned[done] then
    redis.call('ZREMRANGEBYSCORE', done, '-inf', now - keep)
    pruned[done] = true
  end
  if name ~= '' and redis.call('ZADD', done, 'NX', now, name) == 0 then
    -- Applied already: its cost and tokens are in.
    usd, tokens = 0, 0
  else
    redis.call('PEXPIRE', done, keep)
    if redis.call('ZCARD', done) > most then
      redis.call('ZREMRANGEBYRANK', done, 0, -most - 1)
    end
  end
  if usd > 0 then
    redis.call('HINCRBYFLOAT', KEYS[k + 1], 'usd', ARGV[a + 3])
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
