#!/usr/bin/env bash
# Install vLLM 0.33.0's KV offloading code (vllm/v1/kv_offload, the OffloadingConnector) on CPU
# into the virtual environment $1, for kvstage's vLLM adapter and its tests.
#
#   bash tools/install-vllm.sh VENV            install into VENV (which has torch and kvstage)
#   bash tools/install-vllm.sh VENV BASE_VENV  make VENV an overlay of BASE_VENV first: VENV's own
#                                              packages come first, then BASE_VENV's (torch,
#                                              kvstage, pytest), so vLLM's pins never change BASE_VENV
#
# `make test` uses the overlay (.venv-vllm over .venv): vLLM 0.33.0 needs openai 3.57.0, the
# sglang pins hold openai 2.8.0, and one environment cannot hold both.
#
# vLLM's own requirements pin a CUDA torch and hundreds of packages; these modules import on the
# CPU torch with a measured set instead. The pins live beside the repository, in
# ../shared/reference/ (KVSTAGE_PINS_DIR overrides): sglang-0.5.23-cpu-pins.txt (the base set on
# torch 2.13 CPU and triton 3.9) and, on top of it, vllm-0.33.0-cpu-pins.txt, both installed with
# --no-deps exactly as pinned, plus einops (vLLM's ModelConfig imports the model class to inspect
# it, and Llama's module imports einops; the tests build a real VllmConfig for a tiny Llama).
# Idempotent: does nothing when vllm 0.33.0's scheduler, connector and einops already import.
set -euo pipefail
venv=${1:?usage: install-vllm.sh VENV [BASE_VENV]}
base=${2:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
pins_dir=${KVSTAGE_PINS_DIR:-$repo/../shared/reference}
base_pins=$pins_dir/sglang-0.5.23-cpu-pins.txt
vllm_pins=$pins_dir/vllm-0.33.0-cpu-pins.txt

if [ -n "$base" ] && [ ! -x "$venv/bin/python" ]; then
    base_site=$("$base/bin/python" -c 'import site; print(site.getsitepackages()[0])')
    "$base/bin/python" -m venv --without-pip "$venv"
    # Lines of a .pth file that start with "import" run at startup: BASE_VENV's site-packages
    # (and its .pth files: kvstage's editable install) come after this environment's own.
    own_site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
    echo "import site; site.addsitedir('$base_site')" > "$own_site/kvstage-base-venv.pth"
    echo "install-vllm: $venv is an overlay of $base"
fi

for pins in "$base_pins" "$vllm_pins"; do
    if [ ! -f "$pins" ]; then
        echo "install-vllm: $pins is missing: the vLLM pins are read from the shared reference folder beside the repository (or KVSTAGE_PINS_DIR)" >&2
        exit 1
    fi
done

check='import einops, vllm, vllm.v1.kv_offload.tiering.spec, vllm.v1.core.sched.scheduler, vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector; assert vllm.__version__ == "0.33.0", vllm.__version__'
if "$venv/bin/python" -c "$check" 2>/dev/null; then
    echo "install-vllm: vllm 0.33.0 already importable in $venv"
    [ -z "$base" ] || bash "$repo/tools/overlay-scripts.sh" "$venv" "$base"  # an overlay installed before the fix
    exit 0
fi
# pip runs from BASE_VENV's install (the overlay has none) with --prefix set to the overlay and
# --ignore-installed, so every pinned package lands in the overlay whatever BASE_VENV holds.
pip=("$venv/bin/pip")
if [ -n "$base" ]; then
    pip=("$base/bin/python" -m pip)
    target=(--prefix "$venv" --ignore-installed)
else
    target=()
fi
echo "install-vllm: pip install --no-deps -r $(basename "$base_pins") -r $(basename "$vllm_pins") einops"
"${pip[@]}" install --no-deps "${target[@]}" -r "$base_pins"
"${pip[@]}" install --no-deps "${target[@]}" -r "$vllm_pins" "einops==0.8.2"
# BASE_VENV's pip wrote the console scripts (vllm, ...) for BASE_VENV's python: make them the overlay's
[ -z "$base" ] || bash "$repo/tools/overlay-scripts.sh" "$venv" "$base"
if ! "$venv/bin/python" -c "$check"; then
    echo "install-vllm: vllm 0.33.0 does not import in $venv (see above)" >&2
    exit 1
fi
echo "install-vllm: ok, vllm 0.33.0 kv_offload, OffloadingConnector and scheduler import in $venv"
