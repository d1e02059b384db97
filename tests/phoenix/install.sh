#!/usr/bin/env bash
# Installs Arize Phoenix (an OpenTelemetry trace receiver with an API for the spans it holds) into
# its own virtualenv (default .cache/phoenix-venv, reused between runs): its many dependencies
# stay out of the suite's own Python packages. About a minute and a half on a clean machine.
set -euo pipefail
VENV="${1:-$(cd "$(dirname "$0")/../.." && pwd)/.cache/phoenix-venv}"
PHOENIX_VERSION=20.26.1
if [ -x "$VENV/bin/phoenix" ] && "$VENV/bin/python" -c "import phoenix" 2>/dev/null; then
  exit 0
fi
echo "installing Arize Phoenix $PHOENIX_VERSION into $VENV..."
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "arize-phoenix==$PHOENIX_VERSION"
"$VENV/bin/python" -c "import phoenix"
echo "Phoenix installed in $VENV"
