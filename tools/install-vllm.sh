#!/usr/bin/env bash
# Install vLLM 0.33.0's KV offloading code (vllm/v1/kv_offload, the OffloadingConnector) into the
# virtual environment $1 (default .venv) on CPU, for kvstage's vLLM adapter and its tests.
#
# vLLM's own requirements pin a CUDA torch and hundreds of packages; these modules import on the
# CPU torch with a measured set instead. The pins live beside the repository, in
# ../shared/reference/ (KVSTAGE_PINS_DIR overrides): sglang-0.5.23-cpu-pins.txt (the base set on
# torch 2.13 CPU and triton 3.9) and, on top of it, vllm-0.33.0-cpu-pins.txt, both installed with
# --no-deps exactly as pinned, plus einops (vLLM's ModelConfig imports the model class to inspect
# it, and Llama's module imports einops; the tests build a real VllmConfig for a tiny Llama).
# Idempotent: does nothing when vllm 0.33.0 and einops already import.
set -euo pipefail
venv=${1:-.venv}
repo=$(cd "$(dirname "$0")/.." && pwd)
pins_dir=${KVSTAGE_PINS_DIR:-$repo/../shared/reference}
base_pins=$pins_dir/sglang-0.5.23-cpu-pins.txt
vllm_pins=$pins_dir/vllm-0.33.0-cpu-pins.txt

for pins in "$base_pins" "$vllm_pins"; do
    if [ ! -f "$pins" ]; then
        echo "install-vllm: $pins is missing: the vLLM pins are read from the shared reference folder beside the repository (or KVSTAGE_PINS_DIR)" >&2
        exit 1
    fi
done

check='import einops, vllm, vllm.v1.kv_offload.tiering.spec, vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector as c; assert vllm.__version__ == "0.33.0", vllm.__version__'
if "$venv/bin/python" -c "$check" 2>/dev/null; then
    echo "install-vllm: vllm 0.33.0 already importable in $venv"
    exit 0
fi
echo "install-vllm: pip install --no-deps -r $(basename "$base_pins") -r $(basename "$vllm_pins")"
"$venv/bin/pip" install --no-deps -r "$base_pins"
"$venv/bin/pip" install --no-deps -r "$vllm_pins" "einops==0.8.2"
"$venv/bin/python" -c "$check" 2>&1 | grep -v "^WARNING" || true
"$venv/bin/python" -c "$check" 2>/dev/null
echo "install-vllm: ok, vllm 0.33.0 kv_offload and OffloadingConnector import"
