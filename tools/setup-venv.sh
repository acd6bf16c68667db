#!/usr/bin/env bash
# Make the virtual environment $1 (default .venv) with kvstage installed editable and the
# extras $2 (default "test,bench"), its optional C page chains compiled. Reuses a torch that
# python3 already has; on a machine without CUDA installs the CPU build of torch, never a
# multi-gigabyte CUDA build.
set -euo pipefail
venv=${1:-.venv}
extras=${2:-test,bench}
python=${PYTHON:-python3}

if "$python" -c 'import torch' 2>/dev/null; then
    echo "setup: reusing the torch that $python already has"
    "$python" -m venv --system-site-packages "$venv"
else
    "$python" -m venv "$venv"
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: CUDA machine, installing torch from PyPI"
        "$venv/bin/pip" install "torch>=2.4"
    else
        # A CPU wheel lying in pip's find-links (as on these machines) wins; else PyTorch's CPU index.
        local_cpu_wheel=$(ls ${PIP_FIND_LINKS:-/opt/wheels}/torch-*+cpu-*.whl 2>/dev/null | sort -V | tail -n 1 || true)
        if [ -n "$local_cpu_wheel" ]; then
            version=$(basename "$local_cpu_wheel" | cut -d- -f2 | cut -d+ -f1)
            echo "setup: no CUDA, installing the CPU build torch==$version"
            "$venv/bin/pip" install "torch==$version"
        else
            echo "setup: no CUDA, installing torch from the PyTorch CPU index"
            "$venv/bin/pip" install "torch>=2.4" --index-url https://download.pytorch.org/whl/cpu
        fi
    fi
fi
# Headers for the optional C page chains (hashing/_page_chain.c): OpenSSL and xxHash. Without
# them the install still succeeds and the pure-Python chains run; under CI that is an error,
# so the compiled chains are always what CI tests.
if ! bash "$(dirname "$0")/apt-install.sh" gcc libssl-dev libxxhash-dev; then
    [ -z "${CI:-}" ] || { echo "setup: could not install the C headers for the page chains" >&2; exit 1; }
    echo "setup: C headers not installed; the pure-Python page chains will run where they are missing"
fi
"$venv/bin/pip" install -e ".[$extras]"
