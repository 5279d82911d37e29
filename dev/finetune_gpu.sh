#!/usr/bin/env bash
# The fine-tuning experiments of issue 29 on a GPU machine reached through device calls, one step per call:
#
#   bash dev/finetune_gpu.sh build             build attn_qat/_C with the CUDA kernels unless a kept build loads
#                                              (lm and wan do this first too)
#   bash dev/finetune_gpu.sh stash DIR         keep the carried GGUF parts in DIR (e.g. .gguf) under /tmp/gguf_parts,
#                                              which outlives the call while the machine stays warm
#   bash dev/finetune_gpu.sh lm [OPTIONS]      join and check the GGUF (parts from /tmp/gguf_parts and .gguf), run
#                                              examples/finetune_lm.py --out /tmp/finetune_lm OPTIONS
#   bash dev/finetune_gpu.sh wan [OPTIONS]     run examples/finetune_wan.py --out /tmp/finetune_wan OPTIONS
#
# lm and wan resume: runs already under /tmp/finetune_* are skipped, so the same command again (with --max-minutes
# for the call's time limit) finishes what is left. Each leaves a log and a tarball of its results folder in $OUT:
# unpack it into docs/results/. RUN_NAME names the results folder, log and tarball (default finetune_lm /
# finetune_wan), so one machine can hold several experiments. Wheels carried in .whl/ are installed first
# (--target /tmp/site). Set ATTN_QAT_COMMIT to the commit the working tree is at: the machine's copy has no .git.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/attn_qat_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

build() {
    bash dev/build_cuda.sh . "$OUT/build.log" || exit 1
}

step=${1:-}
[ $# -gt 0 ] && shift
case "$step" in
build)
    build
    ;;
stash)
    mkdir -p /tmp/gguf_parts
    cp -v "${1:?usage: stash DIR}"/"$GGUF".part* /tmp/gguf_parts/
    ;;
lm)
    build
    if [ ! -f "/tmp/$GGUF" ]; then
        declare -A found
        for part in /tmp/gguf_parts/"$GGUF".part* .gguf/"$GGUF".part*; do
            [ -f "$part" ] && found[$(basename "$part")]=$part
        done
        if [ ${#found[@]} -eq 0 ]; then
            echo "no parts of $GGUF in /tmp/gguf_parts or .gguf: carry them (dev/split_file.sh)" >&2
            exit 1
        fi
        parts=()
        for name in $(printf '%s\n' "${!found[@]}" | sort); do parts+=("${found[$name]}"); done
        bash dev/join_file.sh "/tmp/$GGUF" "$GGUF_SHA256" "${parts[@]}"
    fi
    name=${RUN_NAME:-finetune_lm}
    (nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true) | tee -a "$OUT/$name.log"
    status=0
    python3 examples/finetune_lm.py --gguf "/tmp/$GGUF" --out "/tmp/$name" "$@" 2>&1 |
        grep --line-buffered -v "Converting and de-quantizing\|Loading weights" | tee -a "$OUT/$name.log" ||
        status=$?
    [ -d "/tmp/$name" ] && tar czf "$OUT/$name.tgz" -C /tmp "$name"
    exit $status
    ;;
wan)
    build
    name=${RUN_NAME:-finetune_wan}
    (nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true) | tee -a "$OUT/$name.log"
    status=0
    python3 examples/finetune_wan.py --out "/tmp/$name" --pretrained /tmp/wan_pretrained.pt "$@" 2>&1 |
        tee -a "$OUT/$name.log" || status=$?
    [ -d "/tmp/$name" ] && tar czf "$OUT/$name.tgz" --exclude=samples -C /tmp "$name"
    exit $status
    ;;
*)
    echo "usage: bash dev/finetune_gpu.sh build | stash DIR | lm [OPTIONS] | wan [OPTIONS]" >&2
    exit 2
    ;;
esac
