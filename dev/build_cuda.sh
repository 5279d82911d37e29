#!/usr/bin/env bash
# On a GPU machine: builds attn_qat/_C with the CUDA kernels in a tree (default: this repository) unless the one
# there already loads with them (a carried build), for the GPU-machine scripts of dev/. Says why a carried build did
# not load; exit status 1 when the build fails, after the end of its log.
#   bash dev/build_cuda.sh [DIR [LOG [JOBS]]]      (LOG: $OUT/build.log; JOBS: every core)
set -uo pipefail
dir=${1:-$(dirname "$0")/..}
log=${2:-${OUT:-/tmp/attn_qat_out}/build.log}
jobs=${3:-$(nproc)}
case $log in /*) ;; *) log=$PWD/$log ;; esac # relative to the caller, not to DIR
mkdir -p "$(dirname "$log")"
cd "$dir" || exit 1
if why=$(PYTHONPATH="$PWD" python3 -c "import attn_qat, sys; sys.exit(0 if attn_qat._C.with_cuda else 'built without the CUDA kernels')" 2>&1); then
    echo "attn_qat/_C in $PWD loads with the CUDA kernels: no build"
    exit 0
fi
echo "attn_qat/_C in $PWD does not load with the CUDA kernels ($(echo "$why" | tail -1)): building"
start=$SECONDS
if ATTN_QAT_CUDA=1 MAX_JOBS=$jobs python3 setup.py build_ext --inplace >"$log" 2>&1; then
    echo "built attn_qat/_C in $PWD in $((SECONDS - start)) s"
else
    tail -50 "$log"
    exit 1
fi
