#!/usr/bin/env bash
# ncu of nopad's sm_90a GEMM (gemm_sm90.cu) on the GPU machine: builds build-gpu (sm_90a only) and profiles one launch
# each of the bias epilogue and the erf-GELU epilogue (CudaPerf.GeluForward, T = 24,657, k=1024 n=4096) and of the
# scale epilogue (the saved GELU derivative, CudaPerf.FfnBackward; profile name bwd-dgelu): speed of light, warp
# states, memory, and per-instruction stall samples (SASS CSV, summarised by scripts/ncu_sass_summary.py into
# NAME-summary.txt) into $OUT. Usage: OUT=... bash scripts/ncu-gemm.sh
#   PROFILES="fwd-bias fwd-gelu bwd-dgelu"   which launches to profile (default: these three; also fwd-gelu-cb0, the
#                                            table with no consumer share, and fwd-gelu-arith, the arithmetic GELU)
#   NCU_EXTRA_SECTIONS="--section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables"  more sections
#                                            (pipe utilisation, shared-memory wavefronts and bank conflicts)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/ncu-gemm}
mkdir -p "$OUT"
export NOPAD_CMAKE_EXTRA=-DCMAKE_CUDA_ARCHITECTURES=90a-real
NOPAD_SKIP_INSTALL=1 NOPAD_BUILD_DIR=build-gpu NOPAD_CMAKE_ARGS="-DNOPAD_CUDA=ON $NOPAD_CMAKE_EXTRA" bash scripts/setup.sh > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
prof() {  # name filter skip
  ncu --clock-control none -k regex:gemm_sm90_kernel --launch-skip $3 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section LaunchStats \
    --section SourceCounters ${NCU_EXTRA_SECTIONS:-} --import-source no -f -o /tmp/$1 ./build-gpu/nopad_cuda_tests --gtest_filter="$2" > /tmp/$1.run 2>&1
  ncu -i /tmp/$1.ncu-rep > $OUT/$1.txt 2>&1
  ncu -i /tmp/$1.ncu-rep --page source --csv --print-source sass > $OUT/$1-sass.csv 2>&1
  # Where the samples fall: by stall reason, opcode, code block (a loop body: equal execution counts), instruction.
  python3 scripts/ncu_sass_summary.py $OUT/$1-sass.csv > $OUT/$1-summary.txt 2>&1 || true
  grep -E "Duration|Throughput|Eligible|Issue Slots|Warp Cycles Per|No Eligible" $OUT/$1.txt | head -20
  head -12 $OUT/$1-summary.txt
}
PROFILES=${PROFILES:-fwd-bias fwd-gelu bwd-dgelu}
# Launch indices of gemm_sm90_kernel in CudaPerf/bf16.GeluForward: 28 per configuration (3 warm-up + 25 timed), the
# bias product first (0-27), then the GELU configurations in the test's order: table with 0, 1, 2 consumer box columns
# (erf, tanh each), then 3 and 4, then the arithmetic GELU likewise. fwd-gelu = table, 1 column, erf.
[[ " $PROFILES " == *" fwd-bias "* ]] && prof fwd-bias 'CudaPerf/bf16.GeluForward' 3
[[ " $PROFILES " == *" fwd-gelu "* ]] && prof fwd-gelu 'CudaPerf/bf16.GeluForward' 87
# fwd-gelu2: table, 2 columns, erf (the default since the shares 0-4 were measured; 140-167).
[[ " $PROFILES " == *" fwd-gelu2 "* ]] && prof fwd-gelu2 'CudaPerf/bf16.GeluForward' 143
[[ " $PROFILES " == *" fwd-gelu-cb0 "* ]] && prof fwd-gelu-cb0 'CudaPerf/bf16.GeluForward' 31
[[ " $PROFILES " == *" fwd-gelu-arith "* ]] && prof fwd-gelu-arith 'CudaPerf/bf16.GeluForward' 255
[[ " $PROFILES " == *" bwd-dgelu "* ]] && prof bwd-dgelu 'CudaPerf/bf16.FfnBackward' 3
ls -la $OUT
