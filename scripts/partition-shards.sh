#!/usr/bin/env bash
# Splits a dataset folder for data.placement = partitioned: OUT/rank<r>/ receives the shards shard_<i>.nopad with
# i % RANKS == r and a copy of dataset.json, for r = 0 .. RANKS-1 (copy each folder to rank r's node-local disk, and
# train with --set data.placement=partitioned --set 'data.train=/that/folder' or a path with {rank} in it).
# Hard links where the file system allows them, copies otherwise. Usage:
#   bash scripts/partition-shards.sh DATASET_DIR OUT_DIR RANKS
set -euo pipefail
if [ $# -ne 3 ]; then
  echo "usage: $0 DATASET_DIR OUT_DIR RANKS" >&2
  exit 2
fi
src=$1 out=$2 ranks=$3
[ -f "$src/dataset.json" ] || { echo "error: $src/dataset.json not found: DATASET_DIR must be a folder made by nopad prepare or nopad convert" >&2; exit 1; }
[[ "$ranks" =~ ^[1-9][0-9]*$ ]] || { echo "error: RANKS must be a positive integer, got '$ranks'" >&2; exit 1; }
shopt -s nullglob
shards=("$src"/shard_*.nopad)
[ ${#shards[@]} -gt 0 ] || { echo "error: no shard_*.nopad files in $src" >&2; exit 1; }
for ((r = 0; r < ranks; r++)); do
  d="$out/rank$r"
  if [ -e "$d" ] && [ -n "$(ls -A "$d")" ]; then
    echo "error: $d exists and is not empty: remove it or choose another OUT_DIR" >&2
    exit 1
  fi
  mkdir -p "$d"
  cp "$src/dataset.json" "$d/"
  [ ! -f "$src/vocab.txt" ] || cp "$src/vocab.txt" "$d/"
done
for f in "${shards[@]}"; do
  name=$(basename "$f")
  i=$((10#${name//[!0-9]/}))
  d="$out/rank$((i % ranks))"
  ln "$f" "$d/$name" 2>/dev/null || cp "$f" "$d/$name"
done
for ((r = 0; r < ranks; r++)); do
  echo "$out/rank$r: $(ls "$out/rank$r" | grep -c '\.nopad$') shards"
done
