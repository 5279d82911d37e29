#!/usr/bin/env bash
# dev/sanitize.py under compute-sanitizer's memcheck, racecheck, synccheck and initcheck (both kernel paths, one
# process a tool), after dev/initcheck_tma.cu, which shows whether initcheck sees the Hopper kernels' TMA stores
# (docs/sanitizers.md). Fails when a tool reports anything, a case fails, or a tool runs past its time limit.
# Usage: dev/sanitize.sh [tool ...]   (default: all four; attn_qat built in place with its CUDA kernels)
#   SANITIZE_TIMEOUT  seconds a tool may run (default 110: the whole script within ~8 minutes)
#   SANITIZE_ARGS     extra arguments for dev/sanitize.py (e.g. "--only decode")
#   SANITIZE_LOGS     where the full reports go (default /tmp/attn_qat_sanitize)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CS="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
LOGS="${SANITIZE_LOGS:-/tmp/attn_qat_sanitize}"
LIMIT="${SANITIZE_TIMEOUT:-110}"
read -r -a ARGS <<<"${SANITIZE_ARGS:-}"
TOOLS=("$@")
[ ${#TOOLS[@]} -gt 0 ] || TOOLS=(memcheck racecheck synccheck initcheck)
mkdir -p "$LOGS"
"$CS" --version | tail -1 || { echo "FAIL: no compute-sanitizer at $CS"; exit 1; }
# Each tensor its own cudaMalloc: memcheck then knows its exact bounds, and initcheck sees its bytes fresh (the
# caching allocator hands out bytes that an earlier tensor initialized).
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
failed=()

summary() { grep -hoE "(ERROR|RACECHECK) SUMMARY: .*" "$1" | tail -1; }

# 1. Does initcheck count TMA-written memory as initialized? plain must be clean and unwritten flagged for the
#    answer to mean anything.
tma_blind=0
if nvcc -O2 -arch=sm_90a -o "$LOGS/initcheck_tma" dev/initcheck_tma.cu; then
    declare -A rc
    for m in plain bulk tensor unwritten; do
        "$CS" --tool initcheck --error-exitcode 1 --print-limit 4 "$LOGS/initcheck_tma" "$m" >"$LOGS/initcheck_tma_$m.log" 2>&1
        rc[$m]=$?
        echo "initcheck_tma $m: exit ${rc[$m]}; $(summary "$LOGS/initcheck_tma_$m.log"); $(grep -h '^initcheck_tma' "$LOGS/initcheck_tma_$m.log")"
    done
    if [ "${rc[plain]}" != 0 ] || [ "${rc[unwritten]}" != 1 ]; then
        echo "FAIL: the reproducer's controls (plain clean, unwritten flagged) did not hold"
        failed+=(initcheck_tma)
    elif [ "${rc[tensor]}" = 1 ]; then
        tma_blind=1
        echo "initcheck does not see cp.async.bulk.tensor stores: a tool limitation (docs/sanitizers.md)"
    elif [ "${rc[tensor]}" != 0 ] || [ "${rc[bulk]}" != 0 ]; then
        echo "FAIL: the reproducer's TMA stores did not land (exit 2 is a wrong sum)"
        failed+=(initcheck_tma)
    else
        echo "initcheck sees TMA stores: its reports on the Hopper path are real"
    fi
else
    echo "FAIL: dev/initcheck_tma.cu did not build"
    failed+=(initcheck_tma)
fi

# 2. The four tools over every kernel family.
run_tool() { # name, log name, compute-sanitizer's arguments [, --, dev/sanitize.py's]
    local name="$1" log="$LOGS/$2.log" start=$SECONDS status cs=() py=()
    shift 2
    while [ $# -gt 0 ] && [ "$1" != -- ]; do cs+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    py=("$@")
    timeout "$LIMIT" "${RUN_ENV[@]}" "$CS" --error-exitcode 1 --print-limit "${PRINT_LIMIT:-20}" "${cs[@]}" \
        python dev/sanitize.py "${ARGS[@]}" "${py[@]}" >"$log" 2>&1
    status=$?
    echo "$name: exit $status in $((SECONDS - start)) s; $(summary "$log"); $(grep -h '^dev/sanitize.py: [0-9]* failed' "$log")"
    grep -h "^FAIL " "$log" | head -5
    [ $status = 0 ] || { failed+=("$name"); [ $status = 124 ] && echo "FAIL: $name ran past ${LIMIT} s"; }
}
RUN_ENV=(env)
for tool in "${TOOLS[@]}"; do
    case "$tool" in
    racecheck) run_tool racecheck racecheck --tool racecheck --racecheck-report hazard ;;
    initcheck)
        if [ $tma_blind = 1 ]; then
            # The tool does not see TMA stores (step 1). The mma.sync path, whose kernels store with plain stores,
            # runs under it as is. The Hopper path runs with the caching allocator on and NaN-poisoned before each
            # call (dev/sanitize.py), so the bytes its TMA stores cover were first written by a kernel the tool
            # sees, and an element the kernels never write reaches the comparison with the reference as NaN; what
            # the tool still reports must be reads it cannot follow: the backward's delta kernel reading the
            # forward's O', and PyTorch's kernels reading outputs TMA wrote. A report in any other of our kernels fails.
            run_tool "initcheck (mma.sync)" initcheck_mma_sync --tool initcheck -- --path mma_sync
            RUN_ENV=(env -u PYTORCH_NO_CUDA_MEMORY_CACHING)
            before=${#failed[@]}
            # printing every report makes this run the slowest: three times the others' limit
            LIMIT=$((3 * LIMIT)) PRINT_LIMIT=1000000 run_tool "initcheck (sm90, poisoned allocator)" initcheck_sm90 --tool initcheck \
                -- --path sm90
            RUN_ENV=(env)
            log="$LOGS/initcheck_sm90.log"
            # Reads in attn_qat's own kernels (the report names the source file) other than the delta kernel's of O';
            # PyTorch's copies of the outputs that TMA wrote (the case's comparison with the reference) are the
            # same tool limitation.
            others=$(grep -A1 "Uninitialized __global__ memory read" "$log" | grep -E "^=+ +at .* in [a-z_0-9]+\.cu" |
                grep -vE "attention_bwd_delta_kernel.* in attention_bwd.cu:[0-9]+$" | sort | uniq -c)
            if [ ${#failed[@]} -gt "$before" ] && [ -z "$others" ] && grep -q "dev/sanitize.py: 0 failed" "$log"; then
                unset 'failed[-1]'
                echo "initcheck (sm90): every report is the delta kernel's read of O' written by TMA (tool limitation)"
            elif [ -n "$others" ]; then
                echo "FAIL: initcheck (sm90) reports reads other than the delta kernel's of O':"; echo "$others" | head
            fi
        else
            run_tool initcheck initcheck --tool initcheck
        fi
        ;;
    memcheck | synccheck) run_tool "$tool" "$tool" --tool "$tool" ;;
    *) echo "unknown tool $tool"; failed+=("$tool") ;;
    esac
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "FAIL: ${failed[*]} (reports in $LOGS)"
    exit 1
fi
echo "ok: ${TOOLS[*]} report nothing on either kernel path (reports in $LOGS)"
