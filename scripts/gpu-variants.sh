#!/usr/bin/env bash
# A quick A/B of environment switches (kernel variants) on the GPU machine: builds nopad and the CUDA tests, runs a
# GoogleTest filter (correctness and CudaPerf lines of the code under test), then times BERT-large training steps on the
# real Wikipedia phase-2 shards under the defaults and under each switch, in alternating rounds so that clock drift
# spreads over all of them, and prints each variant's mean step time against the defaults'. Logs go to $OUT (default
# out/variants).
#   VARIANTS="A=1 B=2,C=3"   the switches, one variant per word (commas join several settings into one variant)
#   ROUNDS=2 BATCH=128       rounds of the alternation; BERT-large batch
#   CUDA_TEST_FILTER=...     GoogleTest filter to run first (unset: no tests)
#   BREAKDOWN=1              each run with --breakdown (an event-timed pass after the timed steps), and a table of
#                            the per-op ms per step, each variant's mean
#   NOPAD_CMAKE_EXTRA        extra CMake arguments (e.g. -DCMAKE_CUDA_ARCHITECTURES=90a-real)
# Needs .carry/enwiki-20150515-AA.txt.xz (a copy of ../shared/data/enwiki's) in the device call's carry.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out/variants}
mkdir -p "$OUT"
ROUNDS=${ROUNDS:-2}
BATCH=${BATCH:-128}
NOPAD=build-gpu/nopad
SHARDS=/tmp/nopad-enwiki-shards
say() { echo "== $(date -u +%T) $*" | tee -a "$OUT/summary.txt"; }
status=0

say "build"
source scripts/gpu-build.sh
build_gpu "$OUT/build.log" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"

if [ -n "${CUDA_TEST_FILTER:-}" ]; then
  say "tests ($CUDA_TEST_FILTER)"
  timeout "${TEST_TIMEOUT:-300}" build-gpu/nopad_cuda_tests --gtest_filter="$CUDA_TEST_FILTER" >"$OUT/tests.log" 2>&1 ||
    { status=1; echo "nopad_cuda_tests failed or timed out" | tee -a "$OUT/summary.txt"; }
  grep -E "^\[ +(OK|FAILED) +\]|PASSED|FAILED|^perf |^  gelu epilogue|differ from" "$OUT/tests.log" |
    tee -a "$OUT/summary.txt"
fi

source scripts/phase2-shards.sh
phase2_shards "$NOPAD" "$SHARDS" || exit 1
say "BERT-large batch $BATCH: defaults and ${VARIANTS:-(no variants)}, $ROUNDS rounds"
for ((r = 1; r <= ROUNDS; ++r)); do
  for V in default ${VARIANTS:-}; do
    envs=()
    [ "$V" = default ] || IFS=, read -r -a envs <<<"$V"
    line=$(env "${envs[@]}" "$NOPAD" bench model --model data/configs/bert-large-mlperf.json --data "$SHARDS" \
      --batch "$BATCH" --steps 20 --warmup 5 ${BREAKDOWN:+--breakdown} 2>>"$OUT/model.err" | grep '^{') ||
      { status=1; continue; }
    echo "{\"variant\": \"$V\", \"round\": $r, ${line#\{}" >>"$OUT/model.jsonl"
    python3 -c "import json,sys; j=json.loads(sys.argv[1]); print('  %-40s round %d  %8.2f ms  %6.1f seq/s  %5.1f GiB  %4.0f MHz' % (sys.argv[2], int(sys.argv[3]), j['step_ms'], j['seqs_per_s'], j['max_mem_gib'], j.get('sm_clock_mhz', 0)))" \
      "$line" "$V" "$r" | tee -a "$OUT/summary.txt"
  done
done
python3 - "$OUT/model.jsonl" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys, collections
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    j = json.loads(line)
    runs[j["variant"]].append(j["step_ms"])
base = sum(runs["default"]) / len(runs["default"])
for v, ms in runs.items():
    m = sum(ms) / len(ms)
    print(f"  {v:40s} mean {m:8.2f} ms over {len(ms)} runs  {m - base:+6.2f} ms vs the defaults ({(m / base - 1) * 100:+.2f}%)")
EOF
if [ -n "${BREAKDOWN:-}" ]; then
  python3 - "$OUT/model.jsonl" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys, collections
ops = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    j = json.loads(line)
    for k, ms in j.get("breakdown_ms_per_step", {}).items():
        ops[j["variant"]][k].append(ms)
variants = list(ops)
mean = lambda x: sum(x) / len(x)
largest = lambda k: max(mean(ops[v][k]) if ops[v].get(k) else 0 for v in variants)
names = sorted({k for v in variants for k in ops[v]}, key=lambda k: -largest(k))
print("  per-op ms per step (mean over rounds): " + " | ".join(variants))
for k in names:
    print(f"  {k:32s}" + "".join(f" {mean(ops[v][k]):9.3f}" if ops[v].get(k) else "         -" for v in variants))
EOF
fi
say "done, status $status"
exit $status
