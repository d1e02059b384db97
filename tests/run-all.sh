#!/usr/bin/env bash
# The whole test suite: unit and integration tests (the real binary against loopback upstreams),
# then the official OpenAI Python SDK end to end. Installs the Python packages it needs.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python3 -c 'import openai, pytest' 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt
fi

cargo build --locked --bins
cargo test --locked
AUTOHEDGE_BIN="$PWD/target/debug/autohedge" python3 -m pytest -q tests/sdk
