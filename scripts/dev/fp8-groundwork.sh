#!/usr/bin/env bash
# The FP8 groundwork on a GPU machine (docs/fp8.md): builds only nopad_cuda_tests and the FP8 product benchmark
# (dev/fp8/gemm_bench.cu) into build-fp8 (CUDA on, sm_90a only, NOPAD_DEV=ON), runs the FP8 GPU tests
# (nopad_cuda_tests --gtest_filter='Fp8*') and the benchmark, and prints a summary last. Installs nothing (the GPU
# machine has no package access: NOPAD_SKIP_INSTALL=1, as scripts/gpu-tests.sh runs there).
# Logs go to $OUT (or out/fp8): configure.log, build.log, tests.log, bench.log, summary.txt.
# Usage: bash scripts/dev/fp8-groundwork.sh
#   FP8_TOKENS=N           benchmark rows (default 93000, a phase-2 step of BERT-large on one GPU)
#   NOPAD_CMAKE_EXTRA=...  extra CMake arguments for the first configure
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=${OUT:-out/fp8}
mkdir -p "$out"
export NOPAD_SKIP_INSTALL=1
build="build-fp8"
status=0
t0=$(date +%s)
: > "$out/summary.txt"
note() { echo "$*" >> "$out/summary.txt"; }

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  # shellcheck disable=SC2086
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DNOPAD_CUDA=ON -DNOPAD_DEV=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a-real ${NOPAD_CMAKE_EXTRA:-} > "$out/configure.log" 2>&1 ||
    { tail -30 "$out/configure.log"; echo "fp8: configure FAILED (see $out/configure.log)"; exit 1; }
fi
if ! cmake --build "$build" --target nopad_cuda_tests dev_fp8_gemm_bench -j "$(nproc)" > "$out/build.log" 2>&1; then
  grep -E "error|FAILED" "$out/build.log" | head -40
  echo "fp8: build FAILED after $(( $(date +%s) - t0 )) s (see $out/build.log)"
  exit 1
fi
note "build: $(( $(date +%s) - t0 )) s ($(nproc) cores)"
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
note "gpu: ${gpu:-unknown}"

t1=$(date +%s)
timeout 240 "./$build/nopad_cuda_tests" --gtest_filter='Fp8*' > "$out/tests.log" 2>&1 || status=1
note "tests (nopad_cuda_tests --gtest_filter='Fp8*', $(( $(date +%s) - t1 )) s):"
grep -E "^\[ +(OK|FAILED) +\]|^\[  PASSED  \]|^\[  FAILED  \]|tests ran" "$out/tests.log" >> "$out/summary.txt"
grep -E "^fp8 epilogue|^shape rows|norm-relative" "$out/tests.log" >> "$out/summary.txt"
if ! grep -q "^\[  PASSED  \]" "$out/tests.log"; then
  note "tests: no PASSED line (a crash or the timeout?); the end of tests.log:"
  tail -5 "$out/tests.log" >> "$out/summary.txt"
  status=1
fi

t2=$(date +%s)
timeout 240 "./$build/dev_fp8_gemm_bench" --tokens "${FP8_TOKENS:-93000}" > "$out/bench.log" 2>&1 || status=1
note "bench (dev_fp8_gemm_bench, $(( $(date +%s) - t2 )) s):"
grep -E "^fp8 bench|^\||^check|^sum|dev_fp8_gemm_bench:" "$out/bench.log" >> "$out/summary.txt"

note "fp8 groundwork: status $status, $(( $(date +%s) - t0 )) s in all"
cat "$out/summary.txt"
exit $status
