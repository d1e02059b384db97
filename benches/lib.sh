# Shared by the bench scripts (sourced).

# wait_addr FILE TEXT: waits (30 s at most) until FILE holds TEXT, then prints what follows TEXT
# on its first such line (a server's "listening on" address).
wait_addr() {
  for _ in $(seq 300); do grep -q "$2" "$1" 2>/dev/null && break; sleep 0.1; done
  sed -n "s|.*$2||p" "$1" | head -1 | tr -d '[:space:]'
}

# start_targets UPSTREAM ENDPOINT_EXTRA PROBE_INTERVAL: starts, in front of UPSTREAM
# (host:port), the overhead bench's bare hyper proxy (the floor; $exe) and the gateway ($BIN;
# audit trail on, access log at info in JSON, as deployed), each its own process under $work;
# sets floor_pid, floor, gw_pid and gw (their addresses). ENDPOINT_EXTRA is added to the
# endpoint's YAML mapping (", timeouts: {...}", or empty).
start_targets() {
  "$exe" --role=proxy --target="$1" > "$work/floor.out" &
  floor_pid=$!
  floor=$(wait_addr "$work/floor.out" "listening on ")
  mkdir -p "$work/gw/logs"
  cat > "$work/gw/config.yaml" <<YAML
models:
  a: { type: openai, base_url: "http://$1/v1", model: gpt-4o-mini$2 }
routing_policy: { fallback_chain: [a] }
health: { probe_interval: $3 }
YAML
  RUST_LOG=info AUTOHEDGE_LOG_FORMAT=json "$BIN" serve --listen 127.0.0.1:0 --config "$work/gw/config.yaml" \
    --data-dir "$work/gw/data" > "$work/gw.out" 2> "$work/gw/logs/gateway.log" &
  gw_pid=$!
  gw=$(wait_addr "$work/gw.out" "listening on http://")
}
