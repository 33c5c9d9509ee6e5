#!/usr/bin/env bash
# Everything the GPU machine checks in one call: build with the CUDA backend, run the whole test suite, report the
# GPUs, and run the Hugging Face compatibility check (transformers is installed there, not in CI).
# Logs go to $OUT (or out/gpu when OUT is unset). Usage: bash scripts/gpu-tests.sh
#   NOPAD_CMAKE_EXTRA="..."   extra CMake arguments (e.g. -DCMAKE_CUDA_ARCHITECTURES=90a-real to build one target)
#   CUDA_TEST_FILTER=PATTERN  GoogleTest filter for nopad_cuda_tests (default: all)
#   SKIP_CTEST=1              skip the CPU test suite (CI runs it; useful when device time is short)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/gpu}
mkdir -p "$out"
export NOPAD_SKIP_INSTALL=1 NOPAD_BUILD_DIR=build-gpu
status=0
step() { echo "== $*" | tee -a "$out/summary.txt"; }

step "build (CUDA on)"
NOPAD_CMAKE_ARGS="-DNOPAD_CUDA=ON ${NOPAD_CMAKE_EXTRA:-}" bash scripts/setup.sh > "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
./build-gpu/nopad info | tee -a "$out/summary.txt"

step "CUDA op tests (nopad_cuda_tests, GPU vs CPU twin)"
./build-gpu/nopad_cuda_tests --gtest_brief=0 --gtest_filter="${CUDA_TEST_FILTER:-*}" > "$out/cuda-tests.log" 2>&1 || status=1
grep -E "^\[ +(OK|FAILED) +\]|PASSED|FAILED|perf|TFLOP" "$out/cuda-tests.log" | tee -a "$out/summary.txt"

if [ "${SKIP_CTEST:-0}" != 1 ]; then
  step "ctest"
  ctest --test-dir build-gpu -j 8 --output-on-failure --timeout 1200 > "$out/ctest.log" 2>&1 || status=1
  tail -15 "$out/ctest.log" | tee -a "$out/summary.txt"
fi

step "Hugging Face compatibility (transformers $(python3 -c 'import transformers; print(transformers.__version__)'))"
hf=/tmp/nopad-hf
./build-gpu/nopad prepare --input data/wiki-sample/wiki_00 --vocab data/vocab/bert-uncased-vocab.txt \
  --output $hf/data --max-seq-length 128 --dupe-factor 1 --overwrite --quiet > "$out/hf.log" 2>&1
./build-gpu/nopad train --config configs/bert-tiny-sample.toml --set run_dir=$hf/run --set data.train=$hf/data \
  --set data.eval=$hf/data --set train.max_steps=20 --overwrite >> "$out/hf.log" 2>&1 || status=1
ckpt=$hf/run/checkpoints/$(cat $hf/run/checkpoints/latest)
for n in 8 32; do
  python3 scripts/hf_compat.py --nopad ./build-gpu/nopad --checkpoint "$ckpt" --data $hf/data --samples $n \
    2>&1 | tee -a "$out/hf.log" "$out/summary.txt" || status=1
done
step "done, status $status"
exit $status
