#!/usr/bin/env bash
# The audit writer's instructions a row in the batches of a load (callgrind; see
# benches/writer.rs): the writer thread of a SMALL- and a LARGE-row run, the difference divided
# by the rows between them, so opening the database and closing it cancel out.
#
#   bash benches/writer.sh                      # SMALL=2000 LARGE=12000
set -euo pipefail
cd "$(dirname "$0")/.."
SMALL=${SMALL:-2000}
LARGE=${LARGE:-12000}
cargo build --release --bench writer --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "writer" and m.get("executable"):
        print(m["executable"])' > target/writer-exe
exe=$(cat target/writer-exe)
mkdir -p target/callgrind/writer
rm -f target/callgrind/writer/cg.*
for n in "$SMALL" "$LARGE"; do
  valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="target/callgrind/writer/cg.$n" \
    "$exe" "$n" 2> /dev/null
done
python3 - "$SMALL" "$LARGE" <<'PY'
import glob, re, sys
small, large = int(sys.argv[1]), int(sys.argv[2])
def writer(n):
    for f in sorted(glob.glob(f"target/callgrind/writer/cg.{n}-*")):
        text = open(f, errors="replace").read()
        if "store::Statements" in text or "store::writer" in text:
            m = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
            return int(m.group(1))
    raise SystemExit(f"no writer thread in the run of {n}")
print(f"audit writer: {(writer(large) - writer(small)) // (large - small)} instructions a row "
      f"({small} rows: {writer(small)}, {large}: {writer(large)})")
PY
