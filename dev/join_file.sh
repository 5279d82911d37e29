#!/usr/bin/env bash
# Joins parts made by dev/split_file.sh, in the order given, and keeps the result only if its SHA-256 matches:
#   bash dev/join_file.sh OUT SHA256 PART...       (SHA256: the hex digest, or a file holding it, e.g. NAME.sha256)
# A missing, truncated or reordered part fails the check: OUT is then not written and the exit status is 1.
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: bash dev/join_file.sh OUT SHA256 PART..." >&2
    exit 2
fi
out=$1 expected=$2
shift 2
if [ -f "$expected" ]; then
    expected=$(cut -d' ' -f1 "$expected")
fi
tmp="$out.joining.$$"
trap 'rm -f "$tmp"' EXIT
cat "$@" >"$tmp"
actual=$(sha256sum "$tmp" | cut -d' ' -f1)
if [ "$actual" != "${expected,,}" ]; then
    echo "join_file.sh: SHA-256 of the joined parts is $actual, expected $expected: $out not written" >&2
    exit 1
fi
mv "$tmp" "$out"
echo "$out: SHA-256 $actual OK"
