#!/usr/bin/env bash
# Install the optional Mooncake store into the virtual environment $1 (default .venv):
# Debian's RDMA/NUMA runtime libraries that the wheel's binaries link against (even for the
# tcp protocol), then the non-CUDA Mooncake wheel, which ships `mooncake.store` and the
# `mooncake_master` binary. Idempotent: installs only what is missing.
set -euo pipefail
venv=${1:-.venv}
spec=${MOONCAKE_SPEC:-mooncake-transfer-engine-non-cuda>=0.3.13}

# The shared libraries mooncake/store.so and mooncake/mooncake_master need at load time.
packages=(libibverbs1 librdmacm1 libnuma1)
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    # A fresh container has empty package lists: update only when apt cannot find a package.
    if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
        $sudo apt-get update -q
    fi
    echo "install-mooncake: apt-get install ${missing[*]}"
    $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if "$venv/bin/python" -c 'import mooncake.store' 2>/dev/null; then
    echo "install-mooncake: mooncake.store already importable in $venv"
else
    echo "install-mooncake: pip install $spec"
    "$venv/bin/pip" install "$spec"
fi
"$venv/bin/python" -c 'import mooncake.store, os, mooncake; print("install-mooncake: ok,", os.path.dirname(mooncake.__file__))'
