#!/usr/bin/env bash
# FP8 against bf16, side by side on one GPU (docs/fp8.md): nopad's bf16 BERT-large step on real phase-2 shards
# (`nopad bench model`, which also writes the timed batches' lengths), then on those same lengths the compiled PyTorch
# peer of ../shared/peers (bf16) and scripts/peer_torch_fp8.py (torchao float8 training, token buckets) under each
# recipe, and the FP8 product benchmark (dev/fp8/gemm_bench.cu) at each token count. Installs nothing; torchao comes
# as a carried wheel. Logs under $OUT (or out/fp8-peers): build.log, bench.log, summary.txt.
# Needs in the device call's carry: .carry (peers/ from ../shared/peers, enwiki-20150515-AA.txt.xz) and .whl (torchao).
#   BATCH (default: 256 on a GPU of 120 GiB or more, else 160: batch 256 of BERT-large needs ~88 GiB)
#   RECIPES="none tensorwise"  FP8_TOKENS="16384 93008"  STEPS=20  BUCKET=8192
#   MASK_BUCKET=2048  PEERS=1 (0: the FP8 product benchmark only)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
out=${OUT:-out/fp8-peers}
mkdir -p "$out"
log="$out/bench.log"
: > "$log"
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ -z "${BATCH:-}" ]; then BATCH=160; [ "${gpu_mib:-0}" -ge 122880 ] && BATCH=256; fi
STEPS=${STEPS:-20}
t0=$(date +%s)
say() { echo "== $(date -u +%T) $*" | tee -a "$log"; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >> "$log" 2>&1 && export PYTHONPATH=/tmp/site:$PWD/.carry/peers || { echo "fp8-peers: torchao install failed"; exit 1; }

build=build-gpu-dev
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
[ -f "$build/CMakeCache.txt" ] || cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DNOPAD_CUDA=ON \
  -DNOPAD_DEV=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real > "$out/build.log" 2>&1
if ! cmake --build "$build" --target nopad dev_fp8_gemm_bench -j "$(nproc)" >> "$out/build.log" 2>&1; then
  grep -E "error|FAILED" "$out/build.log" | head -30; echo "fp8-peers: build FAILED"; exit 1
fi
say "built in $(( $(date +%s) - t0 )) s; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"

source scripts/phase2-shards.sh
shards=/tmp/nopad-enwiki-shards
phase2_shards "$build/nopad" "$shards" "$out/prepare.log" || exit 1
say "shards ready"

# cuBLASLt's own errors, hints and info (log mask 1|4|8) go to a file per run: they say why a product is refused.
for n in ${FP8_TOKENS:-16384 93008}; do
  say "dev_fp8_gemm_bench --tokens $n"
  CUBLASLT_LOG_MASK=13 CUBLASLT_LOG_FILE="$out/cublaslt-$n.log" timeout 120 "$build/dev_fp8_gemm_bench" \
    --tokens "$n" 2>&1 | tee -a "$log" | grep -E "^\||^sum|^check|not supported|error" | head -24
  sed -E "s/^\[[^]]*\]\[cublasLt\]\[[0-9]+\]//" "$out/cublaslt-$n.log" 2>/dev/null |
    grep -iE "error|fail|not supported|unsupported" | sort | uniq -c | head -8 | tee -a "$log"
done

[ "${PEERS:-1}" = 1 ] || { say "done in $(( $(date +%s) - t0 )) s"; exit 0; }
say "nopad bench model bf16 batch $BATCH"
"$build/nopad" bench model --model data/configs/bert-large-mlperf.json --data "$shards" --batch "$BATCH" \
  --steps "$STEPS" --warmup 5 --workload "$out/workload-$BATCH.txt" 2>&1 | tee -a "$log" | grep '^{'
if [ ! -s "$out/workload-$BATCH.txt" ]; then
  tail -5 "$log"
  echo "fp8-peers: nopad bench model wrote no workload (see bench.log; out of memory? set BATCH lower)"; exit 1
fi

say "peer_torch_varlen --compile batch $BATCH"
timeout 240 python3 .carry/peers/peer_torch_varlen.py --batch "$BATCH" --steps "$STEPS" --compile \
  --lengths "$out/workload-$BATCH.txt" 2>&1 | tee -a "$log" | grep '^{' || say "peer_torch_varlen failed"
for r in ${RECIPES:-none tensorwise}; do
  say "peer_torch_fp8 --recipe $r batch $BATCH"
  timeout 300 python3 scripts/peer_torch_fp8.py --batch "$BATCH" --steps "$STEPS" --recipe "$r" \
    --bucket "${BUCKET:-8192}" --mask-bucket "${MASK_BUCKET:-2048}" --lengths "$out/workload-$BATCH.txt" 2>&1 | tee -a "$log" | grep -E '^\{|Error' ||
    say "peer_torch_fp8 $r failed"
done
say "done in $(( $(date +%s) - t0 )) s"
grep -E '^\{' "$log" | sed 's/"breakdown_ms_per_step".*//' > "$out/summary.txt"
