# shellcheck shell=bash
# Sourced by the GPU scripts that time another nopad source tree beside this one (bench.sh and gpu-attention.sh,
# BASE_TREE=DIR, e.g. `git archive <ref> | tar -x -C .carry/base`, carried): its `nopad` built into DIR/build-gpu with
# the CUDA backend and NOPAD_CMAKE_EXTRA.
#   build_base_tree DIR LOG   configures and builds, output to LOG; returns non-zero, with a message and the log's
#                             errors, on failure.
build_base_tree() {
  local tree=$1 log=$2
  if [ ! -f "$tree/CMakeLists.txt" ]; then
    echo "BASE_TREE=$tree has no CMakeLists.txt" >&2
    return 1
  fi
  # shellcheck disable=SC2086
  if ! { cmake -S "$tree" -B "$tree/build-gpu" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNOPAD_CUDA=ON \
           ${NOPAD_CMAKE_EXTRA:-} && cmake --build "$tree/build-gpu" -j "$(nproc)" --target nopad; } >"$log" 2>&1; then
    grep -iE "error|failed" "$log" | head -30 >&2
    echo "the build of the base tree $tree failed (log: $log)" >&2
    return 1
  fi
}
