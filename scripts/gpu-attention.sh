#!/usr/bin/env bash
# The attention measurements on the GPU machine (docs/fmha.md, docs/performance.md): build, the FMHA tests, then
# `nopad bench attention` on real Wikipedia phase-2 lengths (every launch schedule, dropout 0 and 0.1, optionally every
# kernel variant per length group) beside PyTorch's varlen_attn on the same batches, and BERT-large training steps
# with each attention schedule. Logs and JSON lines go to $OUT (default out/attention); a summary is printed last.
#   STAGES="build tests bench peer standin libs model ncu sanitize"   what to run (default: build tests bench peer
#                                 model)
#   LIBS_LENGTHS="512 256 128"    the libs stage: for each length, batches of sequences all that long (LIBS_TOKENS=32768
#                                 tokens per batch), `nopad bench attention` beside PyTorch's own kernels on the same
#                                 shapes (scripts/attention_libs.py: SDPA flash / cuDNN / efficient and varlen_attn)
#   BATCH=128 BATCHES=2           attention batches (sequences per batch, how many)
#   MODEL_BATCH=128               BERT-large batch of the model ablation; MODEL_SCHEDULES="single grouped";
#                                 MODEL_ROUNDS=1 (with BASE_TREE: both trees, alternating, this many times)
#   BWD_VARIANTS="3 5"            backward kernel variants to compare in the bench and model stages (indices of
#                                 docs/fmha.md's list, run as NOPAD_FMHA_BWD_VARIANT); default: the built-in choice
#   BENCH_STREAMS=1,2,4 BENCH_BUCKETS=64,128   the bench stage's --streams and --buckets
#   BENCH_BIAS=1                  the bench and ncu stages' backward also sums the QKV bias gradient (--bias-grad),
#                                 as training does
#   CUDA_TEST_FILTER='Fmha.*'     GoogleTest filter of the tests stage
#   TEST_TIMEOUT=300 BENCH_TIMEOUT=300 MODEL_TIMEOUT=300   seconds before the tests / each attention bench / each
#                                 model run are stopped (a kernel that hangs costs minutes, not the whole device call);
#                                 SANITIZE_TIMEOUT=300 and NCU_TIMEOUT=120 (per profiled launch) the same
#   NCU_KERNELS NCU_DROPOUT NCU_VARIANTS   the ncu stage's kernel regexes, dropout and backward variants (default:
#                                 BWD_VARIANTS); NCU_SCHEDULES="single sorted" profiles each one-launch order (default
#                                 single; the reports of other orders are named ncu-<kernel>-bwd<V>-<order>);
#                                 NCU_SOURCE=1 adds per-instruction stall samples (ncu-*-sass.csv, summarised by
#                                 scripts/ncu_sass_summary.py into ncu-*-summary.txt)
#   NOPAD_CMAKE_EXTRA             extra CMake arguments (e.g. -DCMAKE_CUDA_ARCHITECTURES=90a-real)
#   BASE_TREE=DIR                 another nopad source tree (`git archive <ref> | tar -x -C .carry/base`, carried):
#                                 built too (beside this tree), the bench stage runs its `nopad bench attention` right
#                                 after this tree's, on the same batches, and the model stage its training steps, for a
#                                 before/after in one call
# Needs .carry/enwiki-20150515-AA.txt.xz and .carry/peers/ (copies of ../shared/data/enwiki and ../shared/peers).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out/attention}
mkdir -p "$OUT"
STAGES=${STAGES:-build tests bench peer model}
BATCH=${BATCH:-128}
BATCHES=${BATCHES:-2}
MODEL_BATCH=${MODEL_BATCH:-128}
NOPAD=build-gpu/nopad
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
say() { echo "== $(date -u +%T) $*" | tee -a "$OUT/summary.txt"; }

if has build; then
  say "build${BASE_TREE:+ (and, beside it, the base tree $BASE_TREE)}"
  source scripts/gpu-build.sh
  if [ -n "${BASE_TREE:-}" ]; then  # both at once: each build waits mostly on its few longest CUDA files
    source scripts/base-tree.sh
    build_base_tree "$BASE_TREE" "$OUT/build-base.log" &
    base_pid=$!
  fi
  build_gpu "$OUT/build.log" || exit 1
  if [ -n "${BASE_TREE:-}" ]; then wait "$base_pid" || exit 1; fi
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/summary.txt"
fi

if has tests; then
  say "FMHA tests (${CUDA_TEST_FILTER:-Fmha.*})"
  # A time limit, so that a kernel that hangs (a barrier protocol gone wrong) costs minutes, not the whole call.
  timeout -k 10 "${TEST_TIMEOUT:-300}" build-gpu/nopad_cuda_tests --gtest_filter="${CUDA_TEST_FILTER:-Fmha.*}" \
    >"$OUT/tests.log" 2>&1 || {
    rc=$?  # before anything else runs: 124 (137 once killed) is the time limit, anything else the tests' own failure
    status=1
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
      echo "nopad_cuda_tests stopped at the ${TEST_TIMEOUT:-300} s limit (TEST_TIMEOUT) after" \
        "$(grep -c '^\[       OK' "$OUT/tests.log") passed tests; failed: $(grep -c '^\[  FAILED  \] [A-Za-z]' "$OUT/tests.log")" |
        tee -a "$OUT/summary.txt"
    else
      echo "nopad_cuda_tests failed (rc $rc)" | tee -a "$OUT/summary.txt"
    fi
  }
  grep -E "^\[ +(OK|FAILED) +\]|PASSED|FAILED|planned launches|fmha perf" "$OUT/tests.log" | tee -a "$OUT/summary.txt"
fi

SHARDS=/tmp/nopad-enwiki-shards
if has bench || has model || has ncu || has peer || has standin; then
  source scripts/phase2-shards.sh
  phase2_shards "$NOPAD" "$SHARDS" || exit 1
fi

# Runs "$@" with NOPAD_FMHA_BWD_VARIANT=$1 unless $1 is "default".
with_bwd() {
  local v=$1
  shift
  if [ "$v" = default ]; then "$@"; else NOPAD_FMHA_BWD_VARIANT=$v "$@"; fi
}

if has bench; then
  for V in ${BWD_VARIANTS:-default}; do
    for TREE in this ${BASE_TREE:+base}; do
      BIN=$NOPAD TAG=""
      [ "$TREE" = base ] && BIN=$BASE_TREE/build-gpu/nopad TAG=-base
      say "nopad bench attention (batch $BATCH x $BATCHES, real lengths), backward variant $V, $TREE tree"
      with_bwd "$V" timeout "${BENCH_TIMEOUT:-300}" "$BIN" bench attention --data "$SHARDS" --batch "$BATCH" \
        --batches "$BATCHES" --streams "${BENCH_STREAMS:-1,2,4}" --buckets "${BENCH_BUCKETS:-64,128}" \
        ${VARIANTS:+--variants} ${BENCH_BIAS:+--bias-grad} --workload "$OUT/attn-workload.txt" \
        >"$OUT/attention$TAG-bwd$V.jsonl" 2>"$OUT/attention$TAG-bwd$V.txt" ||
        { status=1; tail -5 "$OUT/attention$TAG-bwd$V.txt"; }
      grep -v "group " "$OUT/attention$TAG-bwd$V.txt" | tee -a "$OUT/summary.txt"
    done
  done
fi

if has peer; then
  say "PyTorch varlen_attn on the same batches"
  (cd .carry/peers && python3 peer_attention.py --batch "$BATCH" --batches "$BATCHES" --lengths "$OUT/attn-workload.txt") \
    2>&1 | grep '^{' | tee "$OUT/peer-attention.jsonl" | tee -a "$OUT/summary.txt" || status=1
fi

# The peers' Gaussian stand-in for MLPerf's phase-2 lengths (mean ~256, more short sequences than this corpus, whose
# batches are 65% full-length): the same comparison on an MLPerf-like mix.
if has standin; then
  (cd .carry/peers && python3 -c "
from common import load_workload
for batch in load_workload(None, $BATCH, $BATCHES):
    for n, m in batch: print(n, m)") >"$OUT/standin-lengths.txt"
  for V in ${BWD_VARIANTS:-default}; do
    say "nopad bench attention on the Gaussian stand-in lengths (mean ~256), backward variant $V"
    with_bwd "$V" "$NOPAD" bench attention --lengths "$OUT/standin-lengths.txt" --batch "$BATCH" --batches "$BATCHES" \
      --streams 1,4 --buckets 64,128 >"$OUT/attention-standin-bwd$V.jsonl" 2>"$OUT/attention-standin-bwd$V.txt" ||
      status=1
    tee -a "$OUT/summary.txt" <"$OUT/attention-standin-bwd$V.txt"
  done
  (cd .carry/peers && python3 peer_attention.py --batch "$BATCH" --batches "$BATCHES" --lengths "$OUT/standin-lengths.txt") \
    2>&1 | grep '^{' | tee -a "$OUT/summary.txt" || status=1
fi

# Fixed lengths: the libraries' easiest input (no padding, no variable-length bookkeeping), for what nopad's kernels
# reach against the best of PyTorch's on the same shapes.
if has libs; then
  for LEN in ${LIBS_LENGTHS:-512 256 128}; do
    NSEQ=$(( ${LIBS_TOKENS:-32768} / LEN ))
    for _ in $(seq $(( 2 * NSEQ ))); do echo "$LEN 0"; done >"$OUT/fixed-$LEN.txt"
    say "fixed length $LEN, $NSEQ sequences: nopad bench attention (one launch), then PyTorch's kernels"
    "$NOPAD" bench attention --lengths "$OUT/fixed-$LEN.txt" --batch "$NSEQ" --batches 2 --schedules single \
      --dropout 0,0.1 >"$OUT/attention-fixed-$LEN.jsonl" 2>"$OUT/attention-fixed-$LEN.txt" || status=1
    grep -v "group " "$OUT/attention-fixed-$LEN.txt" | tee -a "$OUT/summary.txt"
    python3 scripts/attention_libs.py --batch "$NSEQ" --seqlen "$LEN" 2>&1 | grep '^{' |
      tee "$OUT/attention-libs-$LEN.jsonl" | tee -a "$OUT/summary.txt" || status=1
  done
fi

if has model; then
  # With BASE_TREE, each configuration runs in both trees, alternating, MODEL_ROUNDS times (default 1), and the
  # summary gives each tree's mean step time.
  for R in $(seq "${MODEL_ROUNDS:-1}"); do
    for V in ${BWD_VARIANTS:-default}; do
      for S in ${MODEL_SCHEDULES:-single grouped}; do
        for TREE in this ${BASE_TREE:+base}; do
          BIN=$NOPAD
          [ "$TREE" = base ] && BIN=$BASE_TREE/build-gpu/nopad
          say "BERT-large batch $MODEL_BATCH, attention schedule $S, backward variant $V, $TREE tree, round $R"
          with_bwd "$V" timeout "${MODEL_TIMEOUT:-300}" env NOPAD_FMHA_SCHEDULE=$S "$BIN" bench model \
            --model data/configs/bert-large-mlperf.json --data "$SHARDS" --batch "$MODEL_BATCH" --steps 20 --warmup 5 ${BREAKDOWN:+--breakdown} \
            2>"$OUT/model-$S-bwd$V-$TREE-$R.txt" |
            sed "s/^{/{\"attention_schedule\": \"$S\", \"bwd_variant\": \"$V\", \"tree\": \"$TREE\", /" |
            tee -a "$OUT/model.jsonl" | tee -a "$OUT/summary.txt" || status=1
        done
      done
    done
  done
  if [ -n "${BASE_TREE:-}" ]; then
    python3 - "$OUT/model.jsonl" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys, collections
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs[(r["attention_schedule"], r["bwd_variant"], r["tree"])].append(r["step_ms"])
for (s, v, tree), ms in sorted(runs.items()):
    print(f"model step: schedule {s}, backward {v}, {tree:4s} tree: mean {sum(ms) / len(ms):.2f} ms over {len(ms)} runs"
          f" ({', '.join(f'{x:.2f}' for x in ms)})")
EOF
  fi
fi

if has ncu; then
  # One launch of each main kernel (a one-launch forward or backward at dropout NCU_DROPOUT, default 0.1) under ncu:
  # where the time goes, incl. the warp stall reasons. NCU_KERNELS (regexes) defaults to the sm_90a defaults, the
  # wg64 forward and the ws128q backward.
  for V in ${NCU_VARIANTS:-${BWD_VARIANTS:-default}}; do
    for SCH in ${NCU_SCHEDULES:-single}; do
      for K in ${NCU_KERNELS:-fmha_fwd_wgmma fmha_bwd_wsq}; do
        R=$K  # the report name: the regex, plus the schedule unless it is the default one
        [ "$SCH" = single ] || R=$K-$SCH
        say "ncu: $K, backward variant $V, dropout ${NCU_DROPOUT:-0.1}, schedule $SCH"
        with_bwd "$V" timeout -k 10 "${NCU_TIMEOUT:-120}" ncu --clock-control none -k regex:$K --launch-count 1 \
          --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
          --section MemoryWorkloadAnalysis --section LaunchStats --metrics lts__t_sectors_op_red.sum,\
sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,\
smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,\
smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,\
smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,\
smsp__average_warp_latency_issue_stalled_lg_throttle.ratio,smsp__average_warp_latency_issue_stalled_membar.ratio,\
smsp__average_warp_latency_issue_stalled_dispatch_stall.ratio,smsp__average_warp_latency_issue_stalled_sleeping.ratio,\
smsp__average_warp_latency_issue_stalled_misc.ratio,smsp__average_warp_latency_issue_stalled_branch_resolving.ratio,\
smsp__average_warp_latency_issue_stalled_not_selected.ratio,smsp__average_warp_latency_issue_stalled_selected.ratio,\
smsp__average_warp_latency_issue_stalled_no_instruction.ratio,smsp__average_warp_latency_issue_stalled_drain.ratio,\
smsp__average_warp_latency_issue_stalled_imc_miss.ratio,smsp__average_warp_latency_issue_stalled_tex_throttle.ratio \
          ${NCU_SOURCE:+--section SourceCounters --import-source no -f -o "$OUT/ncu-$R-bwd$V"} \
          "$NOPAD" bench attention --data "$SHARDS" --batch "$BATCH" --batches 1 --schedules "$SCH" \
          --dropout "${NCU_DROPOUT:-0.1}" --reps 1 --warmup 0 ${BENCH_BIAS:+--bias-grad} >"$OUT/ncu-$R-bwd$V.txt" 2>&1 ||
          status=1
        if [ -n "${NCU_SOURCE:-}" ]; then  # NCU_SOURCE=1: the report saved, its details and per-instruction stall samples
          ncu -i "$OUT/ncu-$R-bwd$V.ncu-rep" >>"$OUT/ncu-$R-bwd$V.txt" 2>&1
          ncu -i "$OUT/ncu-$R-bwd$V.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu-$R-bwd$V-sass.csv" 2>&1
          python3 scripts/ncu_sass_summary.py "$OUT/ncu-$R-bwd$V-sass.csv" >"$OUT/ncu-$R-bwd$V-summary.txt" 2>&1 || true
          rm -f "$OUT/ncu-$R-bwd$V.ncu-rep"
        fi
        grep -E "Duration|Throughput|Registers Per|Achieved Occupancy|Eligible Warps|Issue Slots|Spilling Requests  |op_red|gmma|wavefronts|inst_executed.sum|stalled|Warp Cycles Per|Active Warps|No Eligible" \
          "$OUT/ncu-$R-bwd$V.txt" | head -60
      done
    done
  done
fi

if has sanitize; then
  say "compute-sanitizer memcheck on the FMHA accuracy tests"
  # The same time limit as the tests: under memcheck a hung kernel would otherwise hold the whole device call.
  timeout -k 10 "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu/nopad_cuda_tests \
    --gtest_filter='Fmha.*Heads2*:Fmha.SeqIndex*:Fmha.Planned*' >"$OUT/sanitize.log" 2>&1 || {
    rc=$?
    status=1
    { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && echo "compute-sanitizer stopped at the ${SANITIZE_TIMEOUT:-300} s limit (SANITIZE_TIMEOUT)" |
      tee -a "$OUT/summary.txt"
  }
  grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/sanitize.log" | tee -a "$OUT/summary.txt"
fi
say "done, status $status"
exit $status
