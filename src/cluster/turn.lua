-- Keeps a `/v1/responses` turn for the other replicas, bounded as each replica bounds its own
-- (`responses.history_max_bytes` in all, `history_max_bytes_per_key` a client key): the turns
-- past their lifetime go, then the key's own oldest while it is over its share, then the
-- oldest of the key holding the most while the whole is over. A turn larger than a key's share
-- is not kept. (The last resort's kept answers use it too, a shelf a model.)
-- KEYS: 1 the turns by time (id -> when kept), 2 this key's turns by time, 3 each turn's size
--       and key (id -> 'bytes key'), 4 the bytes kept (field '_all', and 'k:' .. key)
-- ARGV: 1 the turn's id, 2 its JSON, 3 its lifetime (ms), 4 the most bytes in all, 5 the most
--       a key's, 6 the key ('' : none), 7 the prefix of turn keys, 8 the prefix of key sets,
--       9 `delete` to forget the turn (its bytes with it) instead of keeping one
-- Returns 1 when kept (or forgotten), 0 when not.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, json, life = ARGV[1], ARGV[2], tonumber(ARGV[3])
local most, share, who = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local turn_prefix, key_prefix = ARGV[7], ARGV[8]
local size = string.len(json)
local function drop(old)
  local v = redis.call('HGET', KEYS[3], old)
  redis.call('DEL', turn_prefix .. old)
  redis.call('HDEL', KEYS[3], old)
  redis.call('ZREM', KEYS[1], old)
  if v then
    local bytes, owner = string.match(v, '^(%d+) (.*)$')
    bytes = tonumber(bytes) or 0
    owner = owner or ''
    redis.call('ZREM', key_prefix .. owner, old)
    redis.call('HINCRBY', KEYS[4], '_all', -bytes)
    redis.call('HINCRBY', KEYS[4], 'k:' .. owner, -bytes)
  end
end
if ARGV[9] == 'delete' then
  drop(id)
  return 1
end
if size > share or size > most then
  return 0
end
-- Kept again under the same id: the old one's bytes go first.
if redis.call('HEXISTS', KEYS[3], id) == 1 then
  drop(id)
end
redis.call('SET', turn_prefix .. id, json, 'PX', life)
redis.call('ZADD', KEYS[1], now, id)
redis.call('ZADD', KEYS[2], now, id)
redis.call('HSET', KEYS[3], id, size .. ' ' .. who)
redis.call('HINCRBY', KEYS[4], '_all', size)
redis.call('HINCRBY', KEYS[4], 'k:' .. who, size)
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - life)) do
  drop(old)
end
local function bytes_of(field)
  return tonumber(redis.call('HGET', KEYS[4], field) or '0') or 0
end
while bytes_of('k:' .. who) > share do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not oldest then break end
  drop(oldest)
  -- Gone from the key's set whatever its size entry said (one missing must not loop).
  redis.call('ZREM', KEYS[2], oldest)
end
-- Over the whole: the key holding the most gives its oldest (a key keeping little never loses
-- its values to one keeping much); the oldest of all when no key's can be found.
while bytes_of('_all') > most do
  local fields = redis.call('HGETALL', KEYS[4])
  local top, top_bytes = nil, -1
  for i = 1, #fields, 2 do
    local f = fields[i]
    if string.sub(f, 1, 2) == 'k:' then
      local b = tonumber(fields[i + 1]) or 0
      if b > top_bytes then
        top, top_bytes = string.sub(f, 3), b
      end
    end
  end
  local oldest = nil
  if top then
    oldest = redis.call('ZRANGE', key_prefix .. top, 0, 0)[1]
  end
  if not oldest then
    oldest = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  end
  if not oldest then break end
  drop(oldest)
  if top then
    redis.call('ZREM', key_prefix .. top, oldest)
  end
  redis.call('ZREM', KEYS[1], oldest)
end
for i = 1, 4 do
  redis.call('PEXPIRE', KEYS[i], life + 60000)
end
return 1
