#!/usr/bin/env bash
# The whole test suite: unit and integration tests (the real binary against loopback upstreams),
# the official OpenAI Python SDK end to end, the gateway in front of llama.cpp's server, and our
# token counts against the tiktoken and tokenizers reference implementations.
# Installs the Python packages it needs (tests/requirements.txt).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python3 -c 'import openai, pytest, gguf, numpy, llama_cpp.server.app, tiktoken, tokenizers' 2>/dev/null; then
  echo "installing Python test packages (llama-cpp-python compiles llama.cpp: several minutes)..."
  python3 -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt
fi

cargo build --locked --bins
cargo test --locked
# -rs lists every skip with its reason; with CI=true a skip fails the run (tests/conftest.py).
AUTOHEDGE_BIN="$PWD/target/debug/autohedge" python3 -m pytest -q -rs tests/sdk tests/llamacpp tests/tokens
