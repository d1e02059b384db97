-- What a replica learned about an endpoint, for the fleet: stored (so a replica that starts or
-- reconnects later reads it) and published (so the running ones apply it at once).
-- KEYS: 1 the endpoint's facts (field -> fact). ARGV: 1 field ('-': published only; '' for a
-- clear, which drops them all), 2 the fact (JSON), 3 the message (JSON: origin and fact), 4 the
-- channel ('': stored only, as when a store restarted empty is filled again), 5 lifetime (s).
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1])
elseif ARGV[1] == '-' then
  -- published only
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
end
if ARGV[4] ~= '' then
  redis.call('PUBLISH', ARGV[4], ARGV[3])
end
return 1
