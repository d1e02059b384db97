#!/usr/bin/env bash
# Instructions a request, counted by valgrind's callgrind (repeatable whatever else the machine
# is doing, unlike seconds): the release gateway under callgrind in front of the mock upstream,
# N keep-alive requests from a Python client. Start-up and shutdown are not counted (the
# counters are zeroed after $WARM requests and dumped before shutdown); what each run still
# pays once (the measured client's connection, the idle pause before the dump) cancels out in the
# difference between a 1,000- and a 9,000-request run (SMALL and LARGE). Prints
# the figure, split into the request path, the audit writer and the log writer (one callgrind file
# a thread), and the inclusive cost of the functions named in $FOCUS (a grep pattern) per request.
#
#   cargo build --release --bin autohedge && bash benches/instructions.sh
#   cargo build --profile dist --bin autohedge && BIN=target/dist/autohedge bash benches/instructions.sh
#   SMALL=300 LARGE=1300 bash benches/instructions.sh   # quicker, noisier
#   python3 benches/inclusive.py 1000 9000 'wire::' 30   # then: by function, from the same files
#   STREAM=1 bash benches/instructions.sh   # streamed answers: 32 content chunks 1 ms apart
#                                           # (defaults SMALL=100 LARGE=400)
#   CONC=16 FLOOR=0 bash benches/instructions.sh  # 16 connections at once: the audit
#                                           # writer's cost a row in the batches of a load
#   FLOOR=0 bash benches/instructions.sh    # without the floor (by default the bare hyper proxy
#                                           # of benches/overhead.rs is counted the same way, and
#                                           # benches/versus_floor.py prints the two by component)
#
# Env: LOG_FORMAT (default json), RUST_LOG (default info) — the gateway as deployed.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/autohedge}
FOCUS=${FOCUS:-'telemetry::|access_log|tracing_subscriber::fmt|metrics_exporter_prometheus|Instrumented|executor::execute'}
STREAM=${STREAM:-}
# Connections the client spreads the requests over (each sends its share one after another).
# With 1 the audit writer commits a row or two at a time; with 16 it gathers the batches a
# loaded gateway commits, so its figure is the cost of a row under load.
CONC=${CONC:-1}
FLOOR=${FLOOR:-1}
[ -n "$STREAM" ] && FLOOR=0
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

# Streams: a reply of 32 words, one content chunk a word, 1 ms apart (so every chunk is read on
# its own, as from a generating model).
words=$(python3 -c 'print(" ".join(f"w{i}" for i in range(32)))')
printf 'reply: "%s"\nchunk_delay: 1ms\n' "$words" > "$work/script.yaml"
mock_args=()
[ -n "$STREAM" ] && mock_args=(--script "$work/script.yaml")
"$BIN" mock-upstream --listen 127.0.0.1:0 "${mock_args[@]}" > "$work/mock.out" 2>/dev/null &
for _ in $(seq 100); do grep -q "listening on" "$work/mock.out" 2>/dev/null && break; sleep 0.1; done
mock=$(sed -n 's/.*listening on http:\/\///p' "$work/mock.out")
mkdir -p "$work/conf"
# The config in a directory of its own: the config watcher follows its directory, and the
# gateway's log written beside it would wake the watcher on every write. The endpoint has a
# `context_window`, as the embedded default's do: the gateway counts every prompt's tokens.
cat > "$work/conf/config.yaml" <<EOF
models:
  a: { type: openai, base_url: "http://$mock/v1", model: gpt-4o-mini, context_window: 128000 }
routing_policy: { fallback_chain: [a] }
health: { probe_interval: 1h }
EOF

# The client: $2 requests to $1 on $CONC connections (each sends its share one after another).
client() {
  python3 - "$1" "$2" "$STREAM" "$CONC" <<'PY'
import http.client, json, sys, threading
addr, n, stream, conc = sys.argv[1], int(sys.argv[2]), bool(sys.argv[3]), int(sys.argv[4])
host, port = addr.rsplit(":", 1)
req = {"model": "a", "messages": [{"role": "user", "content": "Hello there"}]}
if stream:
    req["stream"] = True
body = json.dumps(req)
def client(count):
    c = http.client.HTTPConnection(host, int(port), timeout=120)
    for i in range(count):
        c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        r = c.getresponse(); text = r.read()
        assert r.status == 200, r.status
        assert not stream or text.count(b"data: ") >= 33, text[:200]
threads = [threading.Thread(target=client, args=(n // conc + (i < n % conc),)) for i in range(conc)]
for t in threads: t.start()
for t in threads: t.join()
PY
}

# Counts $1 requests into callgrind file $2 (one file a thread: $2.1-NN), of the command given
# after them (the gateway unless given). Start-up is not counted: after $WARM requests (the
# lazily built state, the pools' connections) the counters are zeroed (`callgrind_control -z`),
# and they are dumped once the requests are answered and the audit and log writers have written
# them (a pause longer than their gathers), before shutdown.
run() {
  local n=$1 out=$2
  local log
  log="$work/$(basename "$(dirname "$out")")-$(basename "$out")"
  shift 2
  [ $# -gt 0 ] || set -- "$BIN" serve --listen 127.0.0.1:0 --config "$work/conf/config.yaml" --data-dir "$work/data-$n"
  RUST_LOG=${RUST_LOG:-info} AUTOHEDGE_LOG_FORMAT=${LOG_FORMAT:-json} valgrind --tool=callgrind \
    --separate-threads=yes --callgrind-out-file="$out" "$@" > "$log.out" 2> "$log.err" &
  local pid=$!
  for _ in $(seq 600); do grep -q "listening on" "$log.out" 2>/dev/null && break; sleep 0.1; done
  local addr
  addr=$(sed -n 's/.*listening on \(http:\/\/\)\{0,1\}//p' "$log.out" | head -1)
  client "$addr" "$WARM"
  callgrind_control -z "$pid" > /dev/null
  client "$addr" "$n"
  sleep 0.5
  callgrind_control --dump=measured "$pid" > /dev/null
  kill -TERM "$pid"
  wait "$pid" || true
  # The dump at exit (start-up and shutdown included) is not the measurement.
  rm -f "$out"-[0-9]*
  # A dump made while calls are under way (the workers' loops, parked) records each such call
  # with a count of 0 and its cost so far, which callgrind_annotate adds to the callee's own
  # cost: those calls' costs are set to 0 (the callees' own costs are in their own records).
  python3 - "$out".[0-9]*-[0-9]* <<'PY'
import sys
for path in sys.argv[1:]:
    lines = open(path, errors="replace").read().split("\n")
    for i, line in enumerate(lines[:-1]):
        if line.startswith("calls=0 "):
            fields = lines[i + 1].split()
            lines[i + 1] = " ".join(fields[:1] + ["0"] * (len(fields) - 1))
    open(path, "w").write("\n".join(lines))
PY
}

WARM=${WARM:-300}
if [ -n "$STREAM" ]; then
  SMALL=${SMALL:-100}
  LARGE=${LARGE:-400}
fi
SMALL=${SMALL:-1000}
LARGE=${LARGE:-9000}
mkdir -p target/callgrind
rm -f target/callgrind/cg.small* target/callgrind/cg.large*
run "$SMALL" target/callgrind/cg.small
run "$LARGE" target/callgrind/cg.large
# One file a thread (--separate-threads): the audit writer's cost depends on how many rows each
# commit gathers, which depends on timing (this serial client under valgrind commits a row or
# two at a time; a loaded gateway hundreds), so it is reported apart from the request path.
python3 - "$SMALL" "$LARGE" <<'PY'
import sys
sys.path.insert(0, "benches")
from inclusive import files  # the thread files of a run, in target/callgrind
small, large = int(sys.argv[1]), int(sys.argv[2])
n = large - small
def total(f):
    for line in open(f, errors="replace"):
        if line.startswith("summary:") or line.startswith("totals:"):
            return int(line.split()[1])
    return 0
def role(f):
    text = open(f, errors="replace").read()
    # The writer may be inlined into the closure its thread runs; its statements are not.
    if "store::writer" in text or "store::Statements" in text:
        return "audit writer"
    if "logwriter::run" in text:
        return "log writer"
    return "request path"
def by_role(tag):
    d = {}
    for f in files(tag):
        d[role(f)] = d.get(role(f), 0) + total(f)
    return d
a, b = by_role("small"), by_role("large")
whole = (sum(b.values()) - sum(a.values())) // n
print(f"instructions a request: {whole} ({small} requests: {sum(a.values())}, {large}: {sum(b.values())})")
for k in ("request path", "audit writer", "log writer"):
    print(f"  {k}: {(b.get(k, 0) - a.get(k, 0)) // n}")
PY
echo "inclusive instructions a request, by function matching \$FOCUS:"
python3 benches/inclusive.py "$SMALL" "$LARGE" "$FOCUS" 30
if [ "$FLOOR" != 0 ]; then
  # The floor: the bare hyper pass-through proxy of benches/overhead.rs (its own process), in
  # front of the same mock upstream, counted the same way.
  floor_exe=$(bash benches/overhead-exe.sh)
  mkdir -p target/callgrind/floor
  rm -f target/callgrind/floor/cg.*
  run "$SMALL" target/callgrind/floor/cg.small "$floor_exe" --role=proxy --target="$mock"
  run "$LARGE" target/callgrind/floor/cg.large "$floor_exe" --role=proxy --target="$mock"
  python3 benches/versus_floor.py "$SMALL" "$LARGE"
fi
