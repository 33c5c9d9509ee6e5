#!/usr/bin/env bash
# The GPU-vs-CPU loss-curve check (docs/training.md): bert-base from scratch on real Wikipedia at sequence length
# 128, 300 steps of configs/bert-base-curve.toml, once on the GPU (bf16) and compared with a CPU (fp32) run of the
# same config on the same shards (the shards are byte-identical wherever they are prepared).
#   DEVICE=cuda|cpu bash scripts/curve.sh    trains on that device; metrics land in $OUT/curve-$DEVICE.jsonl
#   CPU_METRICS=FILE                         compare with this CPU run's metrics.jsonl when given
#   SEED=N                                   train.seed (default: the config's); the metrics file is then
#                                            $OUT/curve-$DEVICE-seedN.jsonl
# Needs the corpus at .carry/enwiki-20150515-AA.txt.xz (or CORPUS=path to the .txt) and a built nopad
# (NOPAD=build-gpu/nopad by default).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
DEVICE=${DEVICE:-cuda}
NOPAD=${NOPAD:-build-gpu/nopad}
mkdir -p "$OUT"
DATA=/tmp/nopad-enwiki-128
if [ ! -f "$DATA/dataset.json" ]; then
  CORPUS=${CORPUS:-/tmp/nopad-enwiki-AA.txt}
  [ -f "$CORPUS" ] || xz -dc .carry/enwiki-20150515-AA.txt.xz >"$CORPUS"
  "$NOPAD" prepare --input "$CORPUS" --vocab data/vocab/bert-uncased-vocab.txt --output "$DATA" --max-seq-length 128 \
    --max-predictions 20 --dupe-factor 1 --overwrite --quiet
fi
NAME=curve-$DEVICE${SEED:+-seed$SEED}
RUN=/tmp/nopad-$NAME
"$NOPAD" train --config configs/bert-base-curve.toml --set run_dir="$RUN" --set data.train="$DATA" \
  --set train.device="$DEVICE" ${SEED:+--set train.seed=$SEED} --overwrite >"$OUT/$NAME.log" 2>&1 ||
  { tail -20 "$OUT/$NAME.log"; exit 1; }
grep -E "device:|step (1|100|200|300)/|done" "$OUT/$NAME.log"
cp "$RUN/metrics.jsonl" "$OUT/$NAME.jsonl"
if [ -n "${CPU_METRICS:-}" ]; then
  python3 scripts/compare_curves.py "$OUT/$NAME.jsonl" "$CPU_METRICS" --names "$DEVICE-bf16" cpu-fp32 \
    --window 25 --svg "$OUT/curve.svg"
fi
