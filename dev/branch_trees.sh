#!/usr/bin/env bash
# On a GPU machine whose copy of the working tree has no .git: builds this tree and, beside it, one copy a patch
# (git diff BASE BRANCH, made where the branches are) in /tmp/<patch name>, all at once, for same-machine A/B runs
# of branches that are not merged:
#   here:   git diff main my-branch -- . ':!docs' ':!.*' ':!*.png' > .ab/my-branch.patch
#           (carry .ab; the copies leave out the top's dot folders, so a patch touching .ci/ would not apply, and
#           patch cannot apply a PNG's binary diff)
#   there:  bash dev/branch_trees.sh .ab/my-branch.patch ...
#           (cd /tmp/my-branch && PYTHONPATH=$PWD python3 benchmarks/bench_x.py ...)
# Each build's log goes to $OUT/build_<name>.log; the exit status is 1 when a patch or a build failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/attn_qat_out}"
mkdir -p "$OUT"
repo=$PWD
jobs=$(($(nproc) / ($# + 1)))
[ "$jobs" -ge 1 ] || jobs=1
build() { # DIR NAME
    bash "$repo/dev/build_cuda.sh" "$1" "$OUT/build_$2.log" "$jobs" | tail -1
}
status=0 trees=("$repo") names=(main)
for patch in "$@"; do
    name=$(basename "$patch" .patch)
    rm -rf "/tmp/$name" && mkdir "/tmp/$name"
    # the tree without build outputs or carried extras (dot folders at the top), copied before any build starts
    tar cf - --exclude=./build --exclude='./.[a-z]*' --exclude='*.so' . | tar xf - -C "/tmp/$name"
    if ! (cd "/tmp/$name" && patch -p1 -s --no-backup-if-mismatch <"$repo/$patch"); then
        echo "$name: the patch does not apply" >&2
        status=1
        continue
    fi
    trees+=("/tmp/$name") names+=("$name")
done
pids=()
for i in "${!trees[@]}"; do
    build "${trees[$i]}" "${names[$i]}" & pids+=($!)
done
for i in "${!pids[@]}"; do
    if wait "${pids[$i]}"; then
        echo "${names[$i]}: ready"
    else
        echo "${names[$i]}: build failed, see $OUT/build_${names[$i]}.log" >&2
        status=1
    fi
done
exit $status
