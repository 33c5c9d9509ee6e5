#!/usr/bin/env bash
# Data-pipeline benchmarks (CPU): `nopad prepare` on the 103 MB Wikipedia corpus with MLPerf settings and dupe
# factor 1, at 1 thread and at all threads, then the loader on the resulting shards.
# Usage: bash scripts/bench-data.sh [PATH/enwiki-20150515-AA.txt.xz]   (default ../shared/data/enwiki/...)
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:-../shared/data/enwiki/enwiki-20150515-AA.txt.xz}
work=${NOPAD_BENCH_DIR:-/tmp/nopad-bench}
mkdir -p "$work"
[ -f "$work/enwiki-AA.txt" ] || xz -dkc "$src" > "$work/enwiki-AA.txt"
nopad=${NOPAD_BINARY:-build/nopad}
echo "# $(date -u +%F) $(uname -m), $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
for threads in 1 0; do
  $nopad prepare --input "$work/enwiki-AA.txt" --vocab data/vocab/bert-uncased-vocab.txt \
    --output "$work/enwiki-shards" --dupe-factor 1 --threads $threads --overwrite --quiet
done
$nopad stats "$work/enwiki-shards" | head -4
$nopad bench loader --data "$work/enwiki-shards" --batch 256 --steps 2000
$nopad bench loader --data "$work/enwiki-shards" --batch 256 --steps 2000 --background
