#!/usr/bin/env bash
# Installs and builds (scripts/setup.sh), then runs every test (C++ GoogleTest and Python) through CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ctest --test-dir "${NOPAD_BUILD_DIR:-build}" -j "$(nproc)" --output-on-failure --timeout 1200
