#!/usr/bin/env bash
# Splits a file into numbered parts of at most MIB MiB and writes its SHA-256 beside them:
#   bash dev/split_file.sh FILE DIR [MIB]      ->  DIR/NAME.part00, DIR/NAME.part01, ..., DIR/NAME.sha256
# MIB defaults to 48: the 98 MB SmolLM2 GGUF becomes two parts, each of which travels to a GPU machine with the
# working tree in one device call (64 MiB a call, the tree included). dev/join_file.sh puts them back together.
set -euo pipefail
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
    echo "usage: bash dev/split_file.sh FILE DIR [MIB (default 48)]" >&2
    exit 2
fi
file=$1 dir=$2 mib=${3:-48}
name=$(basename "$file")
mkdir -p "$dir"
rm -f "$dir/$name".part*
split --bytes="${mib}M" --numeric-suffixes --suffix-length=2 "$file" "$dir/$name.part"
sha256sum "$file" | cut -d' ' -f1 >"$dir/$name.sha256"
ls -l "$dir/$name".part*
echo "SHA-256 $(cat "$dir/$name.sha256") -> $dir/$name.sha256"
