# shellcheck shell=bash
# Sourced by the GPU scripts that build this tree's `nopad` and `nopad_cuda_tests` (gpu-attention.sh,
# gpu-variants.sh): Release, the CUDA backend and NOPAD_CMAKE_EXTRA, into build-gpu (configured once per machine).
#   build_gpu LOG   configures and builds, output appended to LOG; returns non-zero, with the log's errors, on failure.
build_gpu() {
  local log=$1
  if [ ! -f build-gpu/CMakeCache.txt ]; then
    # shellcheck disable=SC2086
    cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DNOPAD_CUDA=ON ${NOPAD_CMAKE_EXTRA:-} >>"$log" 2>&1 ||
      { tail -30 "$log" >&2; return 1; }
  fi
  cmake --build build-gpu -j "$(nproc)" --target nopad nopad_cuda_tests >>"$log" 2>&1 ||
    { grep -E "error|FAILED" "$log" | head -30 >&2; return 1; }
}
