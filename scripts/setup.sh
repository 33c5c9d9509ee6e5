#!/usr/bin/env bash
# Installs what nopad needs on Debian/Ubuntu (build tools, libraries, the Python packages the tests use) and builds
# it into build/. Safe to run again: installed packages are skipped, the build is incremental.
#   NOPAD_SKIP_INSTALL=1  build only (for machines without package access, e.g. the GPU machine)
#   NOPAD_BUILD_DIR=DIR   build folder (default build)
#   NOPAD_CMAKE_ARGS=...  extra CMake arguments (e.g. -DNOPAD_CUDA=OFF)
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${NOPAD_BUILD_DIR:-build}

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

if [ "${NOPAD_SKIP_INSTALL:-0}" != 1 ]; then
  packages=(build-essential cmake ninja-build pkg-config libhdf5-dev nlohmann-json3-dev libcli11-dev libgtest-dev
            python3 python3-pip python3-venv xz-utils openmpi-bin libopenmpi-dev zlib1g-dev liblzma-dev libzstd-dev
            zstd librsvg2-bin fonts-dejavu-core
            clang-16 libclang-rt-16-dev)  # the fuzz build (scripts/fuzz.sh): clang with libFuzzer and sanitizers
  missing=()
  for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  # Python packages for the parity and format tests: numpy, h5py, tokenizers (Hugging Face's tokenizer, offline),
  # transformers (AutoTokenizer on nopad's model folders; no torch needed for the tokenizer), mlperf-logging
  # (MLCommons' compliance checker, run on nopad's MLPerf log), tensorboard (its event readers, run on nopad's event
  # files) and pillow (reads the PNGs rsvg-convert renders of nopad report's plots).
  py_packages=(numpy h5py tokenizers transformers mlperf-logging tensorboard pillow)
  if ! python3 -c 'import numpy, h5py, tokenizers, transformers, mlperf_logging, tensorboard, PIL' 2>/dev/null; then
    echo "setup: installing Python packages ${py_packages[*]}"
    python3 -m pip install -q "${py_packages[@]}" 2>/dev/null ||
      python3 -m pip install -q --break-system-packages "${py_packages[@]}"
  fi
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  # shellcheck disable=SC2086
  cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release ${NOPAD_CMAKE_ARGS:-}
fi
cmake --build "$build_dir" -j "$(nproc)"
echo "setup: built $build_dir/nopad"
