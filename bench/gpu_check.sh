#!/usr/bin/env bash
# bench/gpu_check.sh [--dry-run] [--print-caps] [OUTDIR]: the GPU checks of kvstage on a lent GPU
# machine (an H200), in under 8 minutes by construction: every step runs under a cap, the caps
# sum to BUDGET_S < 480 s (checked below, and by tests/test_gpu_check.py), and a step starts
# with at most the budget's remaining time.
#
#   step       cap   what
#   setup      30 s  python packages present (wheels from $WHEELS/.whl only: no network there),
#                    kvstage importable, CUDA visible, nvidia-smi
#   warm       45 s  python bench/gpu_probes.py warm: every Triton variant the probes and the
#                    benchmark launch, compiled by the kernels' warm_up in parallel processes
#                    (Triton's disk cache is shared); soft: what is missing compiles later
#   probes    120 s  python bench/gpu_probes.py probes: host stall (torch.cuda._sleep ~200 ms,
#                    offload/poll/prefetch/load under set_sync_debug_mode("error"), each within
#                    5 ms), allocator race, producer ordering (after=event, producer=), the
#                    layer-by-layer load, the pinned matrix (layouts x int32/int64 x kernel/
#                    staged x staging +0/+2/+4/+8 B x rows of 9, 92, 576, 2048 B, per-layer
#                    scatter), layer-first pinned staging over 2 GiB, the real-model flow on
#                    CUDA -> probes.json
#   tests     135 s  pytest tests/kernels tests/offload natively (test_kernel_strides.py's
#                    strided/offset/expanded index views, test_kernel_ptx.py's 16-byte row
#                    accesses, the gpu-marked tests, the real-model test; cpu-parametrized
#                    Triton tests skip, see tests/conftest.py) -> pytest.xml
#   bench      60 s  python bench/gpu_probes.py bench: gather/scatter vs a same-size pinned
#                    cudaMemcpyAsync (target >= 90%) and a per-page loop (>= 3x at page 16),
#                    triton.testing.do_bench, the max_programs sweep -> bench.json, bench.png
#                    (targets reported as PASS/MISS, not enforced)
#   memcheck   40 s  compute-sanitizer --tool memcheck on gpu_probes.py sanitize (92-byte rows,
#                    bf16 head_dim 46, every mode) with PYTORCH_NO_CUDA_MEMORY_CACHING=1
#   synccheck  25 s  the same under --tool synccheck
#   (sanitizer steps: SKIP with the reason where the binary is absent or the runtime refuses
#   the device; a timeout there is reported, not failed)
#
# Results in OUTDIR (default: $OUT when set, else bench/results/gpu), all at its top level (the
# device tool brings back at most 8 files): 00-summary.txt (read it first: one line per step,
# then every FAIL/WARN/MISS/SKIP line; rewritten after every step), gpu_check.log (all output),
# probes.json, pytest.xml, bench.json, bench.png.
#
# --dry-run (or GPU_CHECK_DRY_RUN=1): on a machine without CUDA, run every step's Python code
# on CPU with tiny sizes (Triton in its interpreter), pytest --collect-only for the tests step,
# and the sanitizer step's script without the sanitizer: tests/test_gpu_check.py runs it so the
# script cannot rot. It claims nothing about a GPU.
#
# Assumptions (a bare machine, the device README's H200 image): bash, coreutils `timeout`,
# python3 >= 3.10 with torch, triton, numpy, xxhash, pytest (and optionally transformers,
# hypothesis, matplotlib, pytest-xdist, pytest-timeout: the image has them), an NVIDIA driver.
# kvstage is not installed: a symlink `kvstage -> <repo>` on PYTHONPATH makes the repository
# importable (its C page chains are then absent: the pure-Python chains run).
# Exit code: 0 every step passed (or skipped with a reason), 1 a step failed, 2 the caps do not
# fit the budget, 3 no CUDA device (and no --dry-run; GPU_CHECK_ALLOW_CPU=1 runs the steps anyway).
set -uo pipefail

# name:cap (seconds), in run order. Their sum must stay within BUDGET_S, and BUDGET_S below
# LIMIT_S (8 minutes), with room for each step's 5 s kill-after and the script's own seconds.
STEPS=(setup:30 warm:45 probes:120 tests:135 bench:60 memcheck:40 synccheck:25)
BUDGET_S=460
LIMIT_S=480
KILL_AFTER_S=5

caps_sum() {
    local total=0 entry
    for entry in "${STEPS[@]}"; do total=$((total + ${entry#*:})); done
    echo "$total"
}

cap_of() {
    local entry
    for entry in "${STEPS[@]}"; do
        if [ "${entry%%:*}" = "$1" ]; then echo "${entry#*:}"; return 0; fi
    done
    echo "gpu_check: no cap for step $1" >&2
    return 1
}

DRY=${GPU_CHECK_DRY_RUN:-0}
outdir=""
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        --print-caps)
            for entry in "${STEPS[@]}"; do echo "${entry%%:*} ${entry#*:}"; done
            echo "sum $(caps_sum)"
            echo "budget $BUDGET_S"
            echo "limit $LIMIT_S"
            exit 0 ;;
        -h | --help) sed -n '2,50p' "${BASH_SOURCE[0]}"; exit 0 ;;
        -*) echo "gpu_check: unknown option $arg" >&2; exit 2 ;;
        *) outdir=$arg ;;
    esac
done

if [ "$(caps_sum)" -gt "$BUDGET_S" ] || [ "$BUDGET_S" -ge "$LIMIT_S" ]; then
    echo "gpu_check: the step caps sum to $(caps_sum) s; they must fit BUDGET_S=$BUDGET_S s, below $LIMIT_S s" >&2
    exit 2
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${outdir:-${OUT:-$repo/bench/results/gpu}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/gpu_check.log"
summary_file="$out/00-summary.txt"

PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # deterministic cuBLAS (the real-model logits)
tmp=$(mktemp -d /tmp/kvstage-gpu-check.XXXXXX)
export MPLCONFIGDIR="$tmp/matplotlib" TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$tmp/triton-cache}
dry_flag=()
if [ "$DRY" = 1 ]; then
    dry_flag=(--dry-run)
    export TRITON_INTERPRET=1  # the Triton paths run in the interpreter on CPU
fi
started=$SECONDS
declare -a summary=()
failed=0

remaining() { echo $((BUDGET_S - (SECONDS - started))); }

write_summary() {
    {
        echo "kvstage gpu_check$([ "$DRY" = 1 ] && echo ' (DRY RUN on CPU: no GPU claims)'): $(date -u '+%Y-%m-%d %H:%M:%S') UTC, $((SECONDS - started)) s of ${BUDGET_S} s"
        echo "device: ${device_line:-unknown}"
        echo "== steps"
        printf '%s\n' "${summary[@]}"
        echo "== FAIL / ERROR lines (pytest's too)"
        grep -E '^(FAIL|FAILED|ERROR) ' "$log" 2>/dev/null | head -n 60
        echo "== WARN / MISS / SKIP lines"
        grep -E '^(WARN|MISS|SKIP|SKIPPED) ' "$log" 2>/dev/null | grep -v '^SKIPPED \[' | head -n 60
        echo "== pytest skips: $(grep -cE '^SKIPPED \[' "$log" 2>/dev/null) reasons (see gpu_check.log)"
        echo "== files: $(cd "$out" && ls | tr '\n' ' ')"
    } >"$tmp/summary.txt" && cp "$tmp/summary.txt" "$summary_file"
}

# run_step NAME [--soft | --soft-timeout] COMMAND...: under a timeout of min(cap, time left).
# --soft: a failure is reported, not failed; --soft-timeout: only a timeout is.
# Exit codes: 0 PASS, 5 PASS (pytest: nothing selected), 77 SKIP (the reason is in the log).
run_step() {
    local name=$1 soft=none
    shift
    case ${1:-} in --soft) soft=all; shift ;; --soft-timeout) soft=timeout; shift ;; esac
    local cap left limit
    cap=$(cap_of "$name") || { summary+=("$name: FAIL (no cap)"); failed=1; return; }
    left=$(remaining)
    limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 5 ]; then
        echo "SKIPPED $name: the ${BUDGET_S} s budget is spent"
        summary+=("$name: SKIPPED (budget spent)")
        [ "$soft" = all ] || failed=1
        write_summary
        return
    fi
    echo "== $name (cap ${cap} s, at most ${limit} s): $*"
    local t0=$SECONDS rc
    timeout --signal=TERM --kill-after=$KILL_AFTER_S "$limit" "$@"
    rc=$?
    local took=$((SECONDS - t0)) line
    case $rc in
        0) line="PASS (${took} s)" ;;
        5) line="PASS, no tests selected (${took} s)" ;;
        77) line="SKIP (${took} s; the reason is in the log)" ;;
        124 | 137) line="TIMEOUT after ${took} s (cap ${cap} s)"
            if [ "$soft" = none ]; then failed=1; else line+=" (soft: not a failure)"; fi ;;
        *) line="FAIL rc=$rc (${took} s)"
            if [ "$soft" = all ]; then line+=" (soft: not a failure)"; else failed=1; fi ;;
    esac
    summary+=("$name: $line")
    write_summary
}

# setup_check: kvstage importable, CUDA visible (writes $tmp/cuda), versions.
setup_check() {
    CUDA_FLAG="$tmp/cuda" "$PY" - <<'EOF'
import importlib.util, os, sys
for name in ("nvtx", "transformers", "hypothesis", "matplotlib", "xdist", "pytest_timeout"):
    if importlib.util.find_spec(name) is None:
        print(f"setup: optional {name} not installed")
import torch, kvstage, kvstage.kernels, kvstage.offload, kvstage.hashing, kvstage.storage
print(f"setup: python {sys.version.split()[0]}, kvstage {kvstage.__version__} from {kvstage.__file__}")
triton = importlib.util.find_spec("triton") and __import__("triton")
print(f"setup: torch {torch.__version__}, triton {getattr(triton, '__version__', 'absent')}, CUDA: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
open(os.environ["CUDA_FLAG"], "w").write("1" if torch.cuda.is_available() else "0")
EOF
}
export -f setup_check
export PY tmp

# sanitize_step TOOL: compute-sanitizer on the sanitize run; rc 77 where it cannot run here.
sanitize_step() {
    local tool=$1 sanitizer
    sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /usr/local/cuda*/compute-sanitizer/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -n 1)
    if [ -z "$sanitizer" ]; then
        echo "SKIP $tool: compute-sanitizer not found (PATH, /usr/local/cuda/bin)"
        [ "$DRY" = 1 ] && [ "$tool" = memcheck ] && { "$PY" "$repo/bench/gpu_probes.py" --dry-run --out "$out" sanitize || return 1; }
        return 77
    fi
    if [ "$DRY" = 1 ]; then
        echo "SKIP $tool: dry run (the sanitize script runs without the sanitizer)"
        [ "$tool" = memcheck ] && { "$PY" "$repo/bench/gpu_probes.py" --dry-run --out "$out" sanitize || return 1; }
        return 77
    fi
    local capture="$tmp/sanitizer-$tool.txt" rc
    # one cudaMalloc per tensor, so an access past a tensor is past an allocation memcheck knows
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool "$tool" --error-exitcode 9 --print-limit 10 \
        "$PY" "$repo/bench/gpu_probes.py" --out "$tmp" sanitize >"$capture" 2>&1
    rc=$?
    tail -n 60 "$capture"
    if [ $rc -ne 0 ] && grep -qiE "device not supported|not supported on this (platform|device)|error 999|unable to (initialize|attach)" "$capture"; then
        echo "SKIP $tool: the runtime refused compute-sanitizer (gVisor machines do; Firecracker ones run it)"
        return 77
    fi
    return $rc
}
export -f sanitize_step
export DRY repo out

main() {
    echo "kvstage gpu_check: repo $repo, results in $out, budget ${BUDGET_S} s (caps sum $(caps_sum) s), $(date -u '+%Y-%m-%d %H:%M:%S') UTC$([ "$DRY" = 1 ] && echo ', DRY RUN')"
    if [ "$DRY" != 1 ]; then
        if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi || true; else echo "nvidia-smi: not found"; fi
        device_line=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
    else
        device_line="cpu (dry run)"
    fi
    write_summary

    # -- setup ----------------------------------------------------------------------------------
    local site="$tmp/site"
    mkdir -p "$site" "$tmp/path"
    ln -s "$repo" "$tmp/path/kvstage"
    export PYTHONPATH="$tmp/path:$site${PYTHONPATH:+:$PYTHONPATH}"
    local missing=()
    read -r -a missing < <("$PY" -c 'import importlib.util as u; print(" ".join(n for n in ["torch", "triton", "numpy", "xxhash", "pytest"] if u.find_spec(n) is None))')
    if [ ${#missing[@]} -gt 0 ]; then
        local wheels=${WHEELS:-$repo/.whl}
        if [ "$DRY" != 1 ] && [ -d "$wheels" ]; then
            echo "setup: installing ${missing[*]} from $wheels into $site"
            "$PY" -m pip install -q --no-index --find-links "$wheels" --target "$site" "${missing[@]}" || echo "FAIL setup: pip could not install ${missing[*]}"
        else
            echo "FAIL setup: missing ${missing[*]} (no network on the GPU machine: carry wheels in .whl/, see the device README)"
        fi
    fi
    run_step setup bash -c setup_check
    if [ "$(cat "$tmp/cuda" 2>/dev/null)" != 1 ] && [ "$DRY" != 1 ]; then
        echo "no CUDA device visible to torch"
        if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
            summary+=("cuda: NONE (set GPU_CHECK_ALLOW_CPU=1 to run the steps anyway, or --dry-run)")
            write_summary
            return 3
        fi
    fi
    cd "$repo" || return 1

    # -- the steps --------------------------------------------------------------------------------
    run_step warm --soft "$PY" bench/gpu_probes.py "${dry_flag[@]}" --out "$out" warm
    run_step probes "$PY" bench/gpu_probes.py "${dry_flag[@]}" --out "$out" probes
    local pytest_args=(-q -rs -p no:cacheprovider --continue-on-collection-errors --junitxml="$out/pytest.xml")
    if [ "$DRY" = 1 ]; then
        run_step tests "$PY" -m pytest tests/kernels/test_kernel_strides.py tests/offload/test_offload_copy_stream.py --collect-only "${pytest_args[@]}"
    else
        "$PY" -c 'import xdist' 2>/dev/null && pytest_args+=(-n 8)
        "$PY" -c 'import pytest_timeout' 2>/dev/null && pytest_args+=(--timeout 100)
        OMP_NUM_THREADS=2 run_step tests "$PY" -m pytest tests/kernels tests/offload "${pytest_args[@]}"
    fi
    run_step bench "$PY" bench/gpu_probes.py "${dry_flag[@]}" --out "$out" bench
    run_step memcheck --soft-timeout bash -c 'sanitize_step memcheck'
    run_step synccheck --soft-timeout bash -c 'sanitize_step synccheck'

    echo "== summary ($((SECONDS - started)) s of ${BUDGET_S} s)"
    printf '%s\n' "${summary[@]}"
    write_summary
    echo "results: $(cd "$out" && ls | tr '\n' ' ')"
    return $failed
}

main 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
rm -rf "$tmp"
exit "$rc"
