#!/usr/bin/env bash
# Builds (if needed) and prints the path of the overhead bench's executable, whose --role=proxy
# is the bare hyper proxy floor and --role=upstream the bench upstream; used by threads.sh and
# instructions.sh. Extra arguments go to cargo (e.g. --profile dist).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo bench --bench overhead --no-run --message-format=json "$@" 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "overhead" in m["target"]["name"]:
        print(m["executable"])'
