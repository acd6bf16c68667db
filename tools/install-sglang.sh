#!/usr/bin/env bash
# Install sglang 0.5.23 for CPU into the virtual environment $1 (default .venv), so the tests in
# tests/integrations/sglang run sglang's own code. The package set is the measured one in
# ../shared/reference/sglang-0.5.23-cpu-pins.txt (read from there, never copied): installed with
# --no-deps because sglang's own requirements pull a CUDA torch and GPU kernels. Also: the C++
# toolchain sglang's page-hash extension builds with on first use (g++, libssl-dev, ninja), and
# the torchvision release of the venv's torch (sglang.srt.configs imports it). Idempotent.
set -euo pipefail
venv=${1:-.venv}
here=$(cd "$(dirname "$0")" && pwd)
pins=${SGLANG_PINS:-$here/../../shared/reference/sglang-0.5.23-cpu-pins.txt}

if [ ! -f "$pins" ]; then
    echo "install-sglang: the pinned package set $pins is missing (set SGLANG_PINS to its path)" >&2
    exit 1
fi
[ -x "$venv/bin/python" ] || { echo "install-sglang: no virtual environment at $venv (run make .venv/.installed)" >&2; exit 1; }

bash "$here/apt-install.sh" g++ libssl-dev ninja-build

if "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("sglang") != "0.5.23")' 2>/dev/null \
    && "$venv/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torchvision") is None)' ; then
    echo "install-sglang: sglang 0.5.23 already in $venv"
else
    started=$(date +%s)
    "$venv/bin/pip" install --no-deps -r "$pins"
    # torchvision's release for the venv's torch (2.13 -> 0.28): a CUDA-free CPU import is all
    # sglang needs of it.
    tv=$("$venv/bin/python" -c 'import torch; major, minor = torch.__version__.split(".")[:2]; print(f"0.{int(minor) + 15}.*")')
    "$venv/bin/pip" install --no-deps "torchvision==$tv"
    echo "install-sglang: installed in $(( $(date +%s) - started )) s"
fi
# The import the tests make (torchvision's CUDA wheel needs a step on CPU: see tests/integrations/sglang/sglang_cpu.py).
PYTHONPATH="$here/../tests/integrations/sglang" "$venv/bin/python" -c '
import sys
from sglang_cpu import import_sglang
missing = import_sglang()
sys.exit(f"install-sglang: {missing}") if missing else print("install-sglang: ok, sglang 0.5.23 imports on CPU")
'
