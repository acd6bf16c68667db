#!/usr/bin/env bash
# Install Dynamo's standalone KV indexer (ai-dynamo-runtime, `python -m dynamo.indexer`) into a
# virtual environment of its own, $1 (default .venv-dynamo), for tests/events/test_dynamo.py: a
# real router's index fed by kvstage's KV events, run as its own process. Its own venv because
# it pins pydantic <= 2.13.5, older than what sglang and vLLM are tested with. Its wheel is Linux
# x86_64 only (abi3, about 75 MB, with pydantic and uvloop). Idempotent: installs only when missing.
set -euo pipefail
venv=${1:-.venv-dynamo}
spec=${DYNAMO_SPEC:-ai-dynamo-runtime==1.6.1}

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if "$venv/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("dynamo.indexer") is None)' 2>/dev/null; then
    echo "install-dynamo: dynamo.indexer already importable in $venv"
else
    echo "install-dynamo: pip install $spec into $venv"
    "$venv/bin/pip" install "$spec"
fi
"$venv/bin/python" -m dynamo.indexer --help >/dev/null
echo "install-dynamo: ok, $venv/bin/python -m dynamo.indexer runs"
