#!/usr/bin/env bash
# bench/gpu_check.sh [OUTDIR]: the GPU checks of kvstage on a lent GPU machine (an H200), in
# under 8 minutes: the GPU tests natively, the kernel benchmarks, and a replay on the GPU.
#
#   1. setup    python packages (installed only where missing) and kvstage made importable
#   2. gpu      pytest -m gpu                      (tests marked gpu)
#   3. kernels  pytest tests/kernels -m "not gpu"  (the kernel tests, cuda and cpu parameters)
#   4. kernel-bench  python bench/gpu_kernels_check.py (kernel correctness on CUDA with pinned
#                staging, bench_kernels, a grid-cap sweep; JSON and PNG in kernels/)
#      bench    python -m bench --only replay      (JSON, markdown, PNG; with --only kernels
#                too when gpu_kernels_check.py is absent)
#   5. cuda     pytest -k cuda -m "not gpu" --ignore=tests/kernels   (the other parts' tests on
#                                                   cuda: offload manager and streams, replay)
#   6. replay   kvstage replay --model llama3-8b   (the built-in trace, 128 KiB of KV a token)
# Steps run in this order (most wanted first) under one budget: a step that would start with
# under 10 s left is skipped and reported.
#
# Results go to OUTDIR (default: $OUT when set, else bench/results/gpu): gpu_check.log (all
# output, with nvidia-smi and a summary), replay-llama3-8b.json, kernels/gpu_check.json,
# kernels/bench_kernels_gpu.json, kernels/bench_kernels_gpu.png, bench/results.json,
# bench/results.md, bench/replay.png: 8 files, at most one folder down (what the device
# tool brings back: at most 8 files, two folders deep).
#
# Assumptions (a bare machine):
#   - bash, coreutils `timeout`, python3 >= 3.10 with pip, and an NVIDIA driver (nvidia-smi).
#   - Python packages already there are used as they are (the device image has torch, triton,
#     numpy, xxhash, rich, pytest, hypothesis, matplotlib). Missing ones are installed with
#     pip into a private folder (--target, added to PYTHONPATH; nothing system-wide): from
#     wheels in $WHEELS (default: .whl/ in the repository) with --no-index when that folder
#     exists, else from the package index (needs the network; torch from PyPI is a CUDA build).
#   - `nvtx` is optional (ranges become no-ops without it).
#   - kvstage is not installed: a symlink `kvstage -> <repo>` in a temporary folder on
#     PYTHONPATH makes the repository importable as the package, as the editable install does.
#   - ../shared (the Mooncake traces) is not needed; tests that read it skip.
# Exit code: 0 when every step passed, 1 when one failed, 3 when there is no CUDA device (set
# GPU_CHECK_ALLOW_CPU=1 to run the steps anyway, e.g. to try the script on a CPU machine).
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-${OUT:-$repo/bench/results/gpu}}
mkdir -p "$out/bench"
out=$(cd "$out" && pwd)
log="$out/gpu_check.log"

BUDGET_S=${GPU_CHECK_BUDGET_S:-460}  # everything, setup included, ends within this many seconds
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
tmp=$(mktemp -d /tmp/kvstage-gpu-check.XXXXXX)
started=$SECONDS
declare -a summary=()
failed=0

remaining() { echo $((BUDGET_S - (SECONDS - started))); }

# step NAME CAP_SECONDS COMMAND...: run under a timeout of min(CAP, time left), record the outcome.
step() {
    local name=$1 cap=$2
    shift 2
    local left
    left=$(remaining)
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 10 ]; then
        echo "== $name: skipped, the ${BUDGET_S}s budget is spent"
        summary+=("$name: SKIPPED (no time left)")
        failed=1
        return
    fi
    echo "== $name (at most ${limit}s): $*"
    local t0=$SECONDS rc
    timeout --signal=TERM --kill-after=10 "$limit" "$@"
    rc=$?
    local took=$((SECONDS - t0))
    case $rc in
        0) summary+=("$name: PASS (${took}s)") ;;
        5) summary+=("$name: PASS, no tests selected (${took}s)") ;;  # pytest: nothing collected
        124 | 137) summary+=("$name: TIMEOUT after ${took}s"); failed=1 ;;
        *) summary+=("$name: FAIL rc=$rc (${took}s)"); failed=1 ;;
    esac
}

main() {
echo "kvstage gpu_check: repo $repo, results in $out, budget ${BUDGET_S}s, $(date -u '+%Y-%m-%d %H:%M:%S') UTC"
if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi || true; else echo "nvidia-smi: not found"; fi

# -- 1. setup ------------------------------------------------------------------------------------
setup() {
    local site="$tmp/site"
    mkdir -p "$site" "$tmp/path"
    ln -s "$repo" "$tmp/path/kvstage"
    export PYTHONPATH="$tmp/path:$site${PYTHONPATH:+:$PYTHONPATH}"
    # One interpreter finds every missing module (import name = pip name for all of these).
    local missing=()
    read -r -a missing < <("$PY" -c 'import importlib.util as u; print(" ".join(n for n in ["torch", "triton", "numpy", "xxhash", "rich", "pytest", "hypothesis", "matplotlib"] if u.find_spec(n) is None))')
    if [ ${#missing[@]} -gt 0 ]; then
        local wheels=${WHEELS:-$repo/.whl}
        echo "setup: installing ${missing[*]} into $site"
        if [ -d "$wheels" ]; then
            "$PY" -m pip install -q --no-index --find-links "$wheels" --target "$site" "${missing[@]}" || return 1
        else
            "$PY" -m pip install -q --target "$site" "${missing[@]}" || return 1
        fi
    fi
    CUDA_FLAG="$tmp/cuda" "$PY" - <<'EOF' || return 1
import importlib.util, os
if importlib.util.find_spec("nvtx") is None:
    print("setup: nvtx not installed (NVTX ranges are no-ops)")
import torch, kvstage, kvstage.kernels, kvstage.offload, kvstage.hashing, kvstage.replay
print(f"setup: kvstage {kvstage.__version__} from {kvstage.__file__}")
print(f"setup: torch {torch.__version__}, CUDA: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
open(os.environ["CUDA_FLAG"], "w").write("1" if torch.cuda.is_available() else "0")
EOF
}
t0=$SECONDS
if setup; then summary+=("setup: PASS ($((SECONDS - t0))s)"); else
    summary+=("setup: FAIL"); failed=1
    printf '%s\n' "== summary" "${summary[@]}"
    return 1
fi

if [ "$(cat "$tmp/cuda" 2>/dev/null)" != 1 ]; then
    echo "no CUDA device visible to torch"
    if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
        printf '%s\n' "== summary" "${summary[@]}" "cuda: NONE (set GPU_CHECK_ALLOW_CPU=1 to run the steps on CPU)"
        return 3
    fi
fi
"$PY" -m kvstage info || true

cd "$repo" || return 1
# -- 2-5. ----------------------------------------------------------------------------------------
step gpu 90 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs
step kernels 150 "$PY" -m pytest tests/kernels -m "not gpu" -q -p no:cacheprovider -rs
local benches=(--only replay)
if [ -f bench/gpu_kernels_check.py ]; then
    # The kernels' own GPU check: correctness on CUDA, bench_kernels, a grid-cap sweep.
    step kernel-bench 180 "$PY" bench/gpu_kernels_check.py --out "$out/kernels"
else
    benches+=(--only kernels)
fi
step bench 90 "$PY" -m bench "${benches[@]}" --out "$out/bench"
step cuda 120 "$PY" -m pytest -k cuda -m "not gpu" --ignore=tests/kernels -q -p no:cacheprovider -rs
step replay 90 "$PY" -m kvstage replay --model llama3-8b --no-progress --json "$out/replay-llama3-8b.json"

rm -rf "$tmp"
echo "== summary ($((SECONDS - started))s of ${BUDGET_S}s)"
printf '%s\n' "${summary[@]}"
echo "results: $(cd "$out" && find . -type f | sort | tr '\n' ' ')"
return $failed
}

main 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
