#!/usr/bin/env bash
# Installs and builds (scripts/setup.sh), then runs every test (C++ GoogleTest and Python) through CTest, then the fuzz
# targets for a bounded time each (scripts/fuzz.sh, docs/fuzzing.md; NOPAD_SKIP_FUZZ=1 leaves them out).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ctest --test-dir "${NOPAD_BUILD_DIR:-build}" -j "$(nproc)" --output-on-failure --timeout 1200
if [ "${NOPAD_SKIP_FUZZ:-0}" != 1 ]; then
  bash scripts/fuzz.sh
fi
