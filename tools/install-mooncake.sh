#!/usr/bin/env bash
# Install the optional Mooncake store into the virtual environment $1 (default .venv):
# Debian's RDMA/NUMA runtime libraries that the wheel's binaries link against (even for the
# tcp protocol), then the non-CUDA Mooncake wheel, which ships `mooncake.store` and the
# `mooncake_master` binary. Idempotent: installs only what is missing.
set -euo pipefail
venv=${1:-.venv}
spec=${MOONCAKE_SPEC:-mooncake-transfer-engine-non-cuda>=0.3.13}

# The shared libraries mooncake/store.so and mooncake/mooncake_master need at load time.
bash "$(dirname "$0")/apt-install.sh" libibverbs1 librdmacm1 libnuma1

if "$venv/bin/python" -c 'import mooncake.store' 2>/dev/null; then
    echo "install-mooncake: mooncake.store already importable in $venv"
else
    echo "install-mooncake: pip install $spec"
    "$venv/bin/pip" install "$spec"
fi
"$venv/bin/python" -c 'import mooncake.store, os, mooncake; print("install-mooncake: ok,", os.path.dirname(mooncake.__file__))'
