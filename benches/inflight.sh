#!/usr/bin/env bash
# Memory a request in flight: what a stall costs. The mock upstream holds every chat request for
# HOLD before it answers, so N requests sent at once are all in flight together; the peak RSS of
# the bare hyper proxy floor (benches/overhead.rs) and of the gateway (audit trail on, access log
# at info in JSON, as deployed) is sampled every 50 ms while they are, and the growth divided by
# N. Each target gets ROUNDS rounds: the first finds the allocator empty, the later ones show
# what a second stall of the same size adds to memory the first left behind.
#
#   cargo build --release --bin autohedge && cargo bench --bench overhead --no-run && bash benches/inflight.sh
#   N=2000 ROUNDS=3 bash benches/inflight.sh
#
# Loopback only; bounded (N requests a round); stops by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/autohedge}
N=${N:-800}
ROUNDS=${ROUNDS:-2}
HOLD=${HOLD:-3s}
exe=$(bash benches/overhead-exe.sh)
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
[ "$(ulimit -n)" -ge $((N * 2 + 100)) ] || { echo "inflight.sh: ulimit -n below $((N * 2 + 100))" >&2; exit 1; }

# shellcheck source=benches/lib.sh
. benches/lib.sh

printf 'rules:\n  - when: { path: /v1/chat/completions }\n    delay: %s\n' "$HOLD" > "$work/hold.yaml"
"$BIN" mock-upstream --listen 127.0.0.1:0 --script "$work/hold.yaml" > "$work/up.out" 2>/dev/null &
up=$(wait_addr "$work/up.out" "listening on http://")
start_targets "$up" ", timeouts: { first_token: 60s, total: 60s }" 1h

round() { # label pid addr
  python3 - "$1" "$2" "$3" "$N" <<'PY'
import asyncio, sys, time
label, pid, addr, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
host, port = addr.rsplit(":", 1)
body = (b'{"model":"a","messages":[{"role":"system","content":"You are terse."},'
        b'{"role":"user","content":"Say hello in one sentence."}],"temperature":0.2}')
req = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n"
       f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
def rss():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
async def one():
    r, w = await asyncio.open_connection(host, int(port))
    w.write(req)
    await w.drain()
    status = (await r.readline()).split(b" ")[1]
    await r.read()
    w.close()
    return status
async def main():
    base = rss()
    tasks = [asyncio.create_task(one()) for _ in range(n)]
    peak = base
    while not all(t.done() for t in tasks):
        await asyncio.sleep(0.05)
        peak = max(peak, rss())
    bad = [t.result() for t in tasks if t.result() != b"200"]
    assert not bad, f"{label}: {len(bad)} answers not 200: {bad[:5]}"
    print(f"{label}\tbefore {base / 1024:5.1f} MB\tpeak {peak / 1024:5.1f} MB\t"
          f"+{(peak - base) / n:5.1f} KB a request in flight", flush=True)
asyncio.run(main())
PY
}

echo "$N requests in flight at once (the upstream holds each $HOLD); RSS of the target process"
for r in $(seq "$ROUNDS"); do
  round "floor   r$r" "$floor_pid" "$floor"
  round "gateway r$r" "$gw_pid" "$gw"
done
kill -TERM "$gw_pid"
wait "$gw_pid" || true
