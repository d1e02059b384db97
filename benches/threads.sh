#!/usr/bin/env bash
# Where the CPU goes under load, by thread: the bare hyper proxy floor and the gateway (audit
# trail on, the access log at info in JSON, as deployed) alternated ROUNDS times under
# `wrk -t1 -c16`, each against the same upstream; the CPU of every thread of the target's process
# (utime + stime from /proc/<pid>/task/*/stat) over the measured window, divided by the requests
# wrk counted. Threads are grouped by name: tokio's workers, the audit writer, the log writer,
# the rest. Unlike the serial callgrind harness (benches/instructions.sh), the audit writer here
# commits the batches a real load gathers.
#
#   cargo build --release --bin autohedge && bash benches/threads.sh
#   ROUNDS=5 SECS=5 BIN=target/dist/autohedge bash benches/threads.sh
#
# Needs wrk (Debian's package). Loopback only; stops by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/autohedge}
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
CONN=${CONN:-16}
command -v wrk >/dev/null || { echo "threads.sh needs wrk (apt-get install -y wrk)" >&2; exit 1; }
exe=$(bash benches/overhead-exe.sh)
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

# shellcheck source=benches/lib.sh
. benches/lib.sh

"$exe" --role=upstream --tag=a > "$work/up.out" &
up=$(wait_addr "$work/up.out" "listening on ")
start_targets "$up" "" 1s

cat > "$work/post.lua" <<'EOF'
wrk.method = "POST"
wrk.body = '{"model":"a","messages":[{"role":"user","content":"Hello there, how are you today?"}]}'
wrk.headers["Content-Type"] = "application/json"
EOF

# name<TAB>user ticks<TAB>system ticks for every thread of a process.
ticks() {
  python3 - "$1" <<'PY'
import glob, sys
for f in glob.glob(f"/proc/{sys.argv[1]}/task/*/stat"):
    try:
        s = open(f).read()
    except OSError:  # the thread ended meanwhile
        continue
    name = s[s.index("(") + 1 : s.rindex(")")]
    rest = s[s.rindex(")") + 2 :].split()
    print(f"{name}\t{rest[11]}\t{rest[12]}")
PY
}

hz=$(getconf CLK_TCK)
measure() { # label pid addr
  local label=$1 pid=$2 addr=$3
  wrk -t1 -c"$CONN" -d1s -s "$work/post.lua" "http://$addr/v1/chat/completions" > /dev/null
  ticks "$pid" > "$work/before"
  wrk -t1 -c"$CONN" -d"${SECS}s" -s "$work/post.lua" "http://$addr/v1/chat/completions" > "$work/wrk.out"
  ticks "$pid" > "$work/after"
  local n
  n=$(awk '/requests in/ {print $1}' "$work/wrk.out")
  if grep -q "Non-2xx" "$work/wrk.out"; then
    echo "$label: wrk saw non-2xx answers:" >&2
    cat "$work/wrk.out" >&2
    exit 1
  fi
  python3 - "$label" "$n" "$hz" "$SECS" "$work/before" "$work/after" <<'PY'
import sys, collections
label, n, hz, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
def load(p):
    d = collections.Counter()
    for line in open(p):
        name, u, k = line.rstrip("\n").split("\t")
        g = {"tokio-runtime-w": "workers", "autohedge-audit": "audit", "autohedge-log": "log"}.get(name, name)
        d[g] += int(u) + int(k)
        d["(user)"] += int(u)
    return d
b, a = load(sys.argv[5]), load(sys.argv[6])
us = {g: (a[g] - b[g]) / hz * 1e6 / n for g in a}
total = sum(v for g, v in us.items() if g != "(user)")
parts = "  ".join(f"{g} {us[g]:.1f}" for g in sorted(us) if us[g] > 0)
print(f"{label}\t{n / secs:.0f} req/s\t{total:.1f} µs/req\t{parts}")
PY
}

echo "wrk -t1 -c$CONN, ${SECS}s a run, $ROUNDS rounds; CPU µs a request of the target process by thread group (clock ticks of 1/${hz} s)"
for r in $(seq "$ROUNDS"); do
  measure "floor   r$r" "$floor_pid" "$floor"
  measure "gateway r$r" "$gw_pid" "$gw"
done
kill -TERM "$gw_pid"
wait "$gw_pid" || true
