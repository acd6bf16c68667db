#!/usr/bin/env bash
# Point an overlay environment's console scripts at its own python.
#
#   bash tools/overlay-scripts.sh VENV BASE_VENV
#
# tools/install-vllm.sh installs into the overlay VENV with BASE_VENV's pip (--prefix VENV), and
# pip writes each console script's shebang for the python that runs it: VENV/bin/vllm would
# start BASE_VENV's python, which cannot import vllm ("No module named 'vllm'"). This rewrites
# every script in VENV/bin whose shebang names BASE_VENV's python (the "#!PYTHON" line, or the
# "'''exec' PYTHON" line pip writes under "#!/bin/sh" for long paths) to VENV/bin/python.
# Other files are left as they are. Idempotent.
set -euo pipefail
venv=${1:?usage: overlay-scripts.sh VENV BASE_VENV}
base=${2:?usage: overlay-scripts.sh VENV BASE_VENV}
venv=$(cd "$venv" && pwd)
base=$(cd "$base" && pwd)
own="$venv/bin/python"
changed=0
for script in "$venv"/bin/*; do
    [ -f "$script" ] && [ ! -L "$script" ] || continue
    head -c 2 "$script" | grep -q '^#!' || continue
    # sed patterns: BASE_VENV's path with regex characters escaped
    base_re=$(printf '%s' "$base/bin/python" | sed 's/[.[\*^$|]/\\&/g')
    if sed -n '1,2p' "$script" | grep -Eq "^#!$base_re[0-9.]*\$|^'''exec' '?$base_re[0-9.]*'? "; then
        sed -i -E "1s|^#!$base_re[0-9.]*\$|#!$own|; 2s|^'''exec' '?$base_re[0-9.]*'? |'''exec' '$own' |" "$script"
        changed=$((changed + 1))
    fi
done
echo "overlay-scripts: $changed console scripts in $venv/bin now run $own"
