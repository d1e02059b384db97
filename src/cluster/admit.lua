-- Admissions for one client key, atomically for the whole fleet, each as if alone and in order:
-- the budget (what is spent this month plus what running requests reserved), then `rpm`, then
-- `tpm`; nothing is taken for a request unless everything passes. Buckets hold a minute's worth
-- and refill continuously (the in-process limits' rule), on Redis's own clock so the replicas'
-- clocks do not matter. Requests that asked while the last call ran come in one call.
-- KEYS: 1 rpm bucket, 2 tpm bucket, 3 the month's spend, 4 reservations (id -> expiry),
--       5 reservation amounts (id -> usd), 6 the reservations' total
-- Requests of the key that ended meanwhile ride along (settled first, as settle.lua would).
-- A key without a budget may also take a lease: a share of its buckets taken ahead, which the
-- replica spends on its own (no call a request). It is granted only while the bucket stays over
-- half full after it, at most 1/(2 * replicas) of what is above half, and never below the
-- fewest asked. A bucket's level and its leases outstanding together never pass its capacity
-- (the level is capped at capacity minus what is leased), so the fleet admits no more than one
-- process would. A lease ends by being given back (what is left returns to the bucket) or, when
-- its replica is gone, by its expiry.
-- KEYS: 1 rpm bucket, 2 tpm bucket, 3 the month's spend, 4 reservations (id -> expiry),
--       5 reservation amounts (id -> usd), 6 the reservations' total, 7 leases (id -> expiry),
--       8 lease amounts (id -> 'requests tokens'; '_r', '_t': the totals outstanding)
-- ARGV: 1 rpm (0: none), 2 tpm (0: none), 3 budget (-1: none), 4 how long a reservation is held
--       at most (ms), 5 settles, 6 the spend's lifetime (s), 7 lease requests asked (0: no
--       lease), 8 lease tokens asked, 9 live replicas, 10 the fewest requests and 11 the fewest
--       tokens worth a lease, 12 the new lease's id, 13 its lifetime (ms), 14 a lease given back
--       ('': none), 15 its requests and 16 its tokens left, 17 how long settles' names are
--       remembered (ms); then four a settle: reservation id ('' : none), usd, completion
--       tokens, the settle's name (applied once: see settle.lua); then three a request:
--       tokens, reservation usd, request id
-- KEYS: 9 the settles' names applied (name -> when)
-- Returns five a request: verdict, usd spent (text), retry after ms, reset ms, remaining (text);
-- then the lease: granted (1/0), requests, tokens.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local budget, hold = tonumber(ARGV[3]), tonumber(ARGV[4])
local settles, ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local lr, lt, nrep = tonumber(ARGV[7]), tonumber(ARGV[8]), math.max(1, tonumber(ARGV[9]))
local minr, mint = tonumber(ARGV[10]), tonumber(ARGV[11])
local lease_id, life = ARGV[12], tonumber(ARGV[13])
local back_id, backr, backt = ARGV[14], tonumber(ARGV[15]), tonumber(ARGV[16])
local keep = tonumber(ARGV[17])
-- The settles' names a key keeps at most, as in settle.lua.
local most = 100000
local first = 18 + settles * 4
-- Leases outstanding: those past their expiry end (their replica did not give them back).
local o = redis.call('HMGET', KEYS[8], '_r', '_t')
local or_, ot = tonumber(o[1]) or 0, tonumber(o[2]) or 0
local leases_changed = false
local function lease_ends(id)
  local a = redis.call('HGET', KEYS[8], id)
  redis.call('HDEL', KEYS[8], id)
  if a then
    local r, tk = string.match(a, '^(%S+) (%S+)$')
    or_ = math.max(0, or_ - (tonumber(r) or 0))
    ot = math.max(0, ot - (tonumber(tk) or 0))
  end
  leases_changed = true
end
if or_ > 0 or ot > 0 then
  local expired = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now)
  for _, id in ipairs(expired) do
    lease_ends(id)
  end
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now)
  end
end
if back_id ~= '' and redis.call('ZREM', KEYS[7], back_id) == 1 then
  lease_ends(back_id)
end
local charged = 0
if settles > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[9], '-inf', now - keep)
end
for i = 18, first - 1, 4 do
  local id, spent_usd, tokens = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local name = ARGV[i + 3]
  if id ~= '' and redis.call('ZREM', KEYS[4], id) == 1 then
    local held = tonumber(redis.call('HGET', KEYS[5], id) or '0') or 0
    redis.call('HDEL', KEYS[5], id)
    redis.call('INCRBYFLOAT', KEYS[6], -held)
  end
  if name ~= '' and redis.call('ZADD', KEYS[9], 'NX', now, name) == 0 then
    -- Applied already (a call that timed out but ran): nothing twice.
    spent_usd, tokens = 0, 0
  elseif name ~= '' then
    redis.call('PEXPIRE', KEYS[9], keep)
    if redis.call('ZCARD', KEYS[9]) > most then
      redis.call('ZREMRANGEBYRANK', KEYS[9], 0, -most - 1)
    end
  end
  if spent_usd > 0 then
    redis.call('HINCRBYFLOAT', KEYS[3], 'usd', ARGV[i + 1])
    redis.call('EXPIRE', KEYS[3], ttl)
  end
  if tokens > 0 then
    charged = charged + tokens
  end
end
local usd = tonumber(redis.call('HGET', KEYS[3], 'usd') or '0') or 0
local reserved = 0
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
  reserved = math.max(0, tonumber(redis.call('GET', KEYS[6]) or '0') or 0)
end
local function level(key, cap, leased)
  local v = redis.call('HMGET', key, 'l', 't')
  local l, at = tonumber(v[1]), tonumber(v[2])
  if l == nil or at == nil then
    return cap - leased
  end
  return math.min(cap - leased, l + math.max(0, now - at) * cap / 60000)
end
local function ms(n)
  return math.max(0, math.ceil(n))
end
local rl, tl
local rtaken, ttaken, out = false, false, {}
if rpm > 0 then
  rl = level(KEYS[1], rpm, or_)
  if backr > 0 then
    rl = math.min(rpm - or_, rl + backr)
    rtaken = true
  end
end
if tpm > 0 then
  tl = level(KEYS[2], tpm, ot)
  if backt > 0 then
    tl = math.min(tpm - ot, tl + backt)
    ttaken = true
  end
  if charged > 0 then
    -- Completion tokens of ended requests: below zero if need be (a day's tokens at most).
    tl = math.max(tl - charged, -tpm * 1440)
    ttaken = true
  end
end
local spent = tostring(usd)
for i = first, #ARGV - 2, 3 do
  local tokens, reserve, id = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), ARGV[i + 2]
  local v
  if budget >= 0 and usd + reserved >= budget then
    v = {'budget', spent, 0, 0, '0'}
  elseif rl and rl < 1 then
    v = {'requests', spent, ms((1 - rl) * 60000 / rpm), ms((rpm - rl) * 60000 / rpm), '0'}
  elseif tl and tokens > 0 and tokens > tpm then
    v = {'tokens', spent, 60000, ms((tpm - tl) * 60000 / tpm), tostring(math.max(0, math.floor(tl)))}
  elseif tl and tokens > 0 and tokens > tl then
    v = {'tokens', spent, ms((tokens - tl) * 60000 / tpm), ms((tpm - tl) * 60000 / tpm),
         tostring(math.max(0, math.floor(tl)))}
  else
    if rl then
      rl = rl - 1
      rtaken = true
    end
    if tl and tokens > 0 then
      tl = tl - tokens
      ttaken = true
    end
    if budget >= 0 and reserve > 0 then
      redis.call('ZADD', KEYS[4], now + hold, id)
      redis.call('HSET', KEYS[5], id, tostring(reserve))
      redis.call('INCRBYFLOAT', KEYS[6], reserve)
      reserved = reserved + reserve
    end
    v = {'ok', spent, 0, 0, '0'}
  end
  for _, x in ipairs(v) do
    out[#out + 1] = x
  end
end
local granted, gr, gt = 0, 0, 0
if budget < 0 and (lr > 0 or lt > 0) and (rl or tl) then
  granted = 1
  if rl then
    gr = math.min(lr, math.floor((rl - rpm / 2) / (2 * nrep)))
    if gr < minr then
      granted = 0
    end
  end
  if tl then
    gt = math.min(lt, math.floor((tl - tpm / 2) / (2 * nrep)))
    if gt < mint then
      granted = 0
    end
  end
  if granted == 1 then
    if rl then
      rl = rl - gr
      or_ = or_ + gr
      rtaken = true
    end
    if tl then
      tl = tl - gt
      ot = ot + gt
      ttaken = true
    end
    redis.call('ZADD', KEYS[7], now + life, lease_id)
    redis.call('HSET', KEYS[8], lease_id, string.format('%d %d', gr, gt))
    leases_changed = true
  else
    gr, gt = 0, 0
  end
end
out[#out + 1] = granted
out[#out + 1] = math.max(0, gr)
out[#out + 1] = math.max(0, gt)
local function put(key, cap, l)
  redis.call('HSET', key, 'l', tostring(l), 't', now)
  -- Gone once it would be full again: a missing bucket reads as full.
  redis.call('PEXPIRE', key, ms((cap - l) * 60000 / cap) + 1000)
end
if leases_changed then
  redis.call('HSET', KEYS[8], '_r', tostring(or_), '_t', tostring(ot))
  redis.call('PEXPIRE', KEYS[7], life + 60000)
  redis.call('PEXPIRE', KEYS[8], life + 60000)
end
if rtaken then
  put(KEYS[1], rpm, rl)
end
if ttaken then
  put(KEYS[2], tpm, tl)
end
return out
