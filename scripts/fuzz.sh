#!/usr/bin/env bash
# Builds nopad's libFuzzer targets (tests/fuzz, docs/fuzzing.md) with clang-16, AddressSanitizer and
# UndefinedBehaviorSanitizer into their own build folder, and runs each for a bounded time starting from its seed
# corpus (tests/fuzz/corpus/TARGET) and its regression inputs (tests/fuzz/regressions/TARGET), which it runs first.
# Prints the executions per target; exits non-zero when any target found a crash, a sanitizer report, a leak, a
# timeout or an out-of-memory (the input that did it is saved under BUILD/fuzz-artifacts/TARGET/).
#   NOPAD_FUZZ_SECONDS=N     seconds of fuzzing per target (default 20; CI runs the default)
#   NOPAD_FUZZ_TARGETS="a b" targets to run (default: all, see tests/fuzz/fuzz_targets.h)
#   NOPAD_FUZZ_BUILD_DIR=DIR build folder (default build-fuzz)
#   NOPAD_FUZZ_ARGS="..."    extra libFuzzer flags (e.g. -jobs=2 -workers=2 for a longer local run)
# Found inputs accumulate in BUILD/fuzz-work/TARGET/, so a later local run goes on from there.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${NOPAD_FUZZ_BUILD_DIR:-build-fuzz}
seconds=${NOPAD_FUZZ_SECONDS:-20}
all_targets=(shard_reader text_input tokenizer tfrecord hdf5 tf_checkpoint config)
read -r -a targets <<<"${NOPAD_FUZZ_TARGETS:-${all_targets[*]}}"

cc=${NOPAD_FUZZ_CC:-clang-16}
cxx=${NOPAD_FUZZ_CXX:-clang++-16}
if ! command -v "$cxx" >/dev/null || ! command -v "$cc" >/dev/null; then
  echo "fuzz: $cxx not found: install clang-16 and libclang-rt-16-dev (bash scripts/setup.sh does)" >&2
  exit 1
fi

t0=$(date +%s)
if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  # -O1: sanitizer builds compile much faster and run about as fast as at -O3 (docs/fuzzing.md).
  CC=$cc CXX=$cxx cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=None \
    -DCMAKE_C_FLAGS=-O1 -DCMAKE_CXX_FLAGS=-O1 -DNOPAD_CUDA=OFF -DNOPAD_FUZZ=ON -DNOPAD_TESTS=OFF \
    ${NOPAD_FUZZ_CMAKE_ARGS:-} >/dev/null
fi
cmake --build "$build_dir" -j "$(nproc)" --target nopad_fuzzers
echo "fuzz: built $build_dir in $(($(date +%s) - t0)) s"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:symbolize=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tests/fuzz/lsan.supp:print_suppressions=0}
failed=()
summary=()
for t in "${targets[@]}"; do
  bin="$build_dir/fuzz_$t"
  [ -x "$bin" ] || { echo "fuzz: no target $t ($bin)" >&2; exit 1; }
  work="$build_dir/fuzz-work/$t"
  artifacts="$build_dir/fuzz-artifacts/$t/"
  mkdir -p "$work" "$artifacts"
  dirs=("$work" "tests/fuzz/corpus/$t")
  [ -d "tests/fuzz/regressions/$t" ] && dirs+=("tests/fuzz/regressions/$t")
  log="$build_dir/fuzz-$t.log"
  echo "fuzz: $t for $seconds s (log $log)"
  rc=0
  # shellcheck disable=SC2086
  "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$artifacts" ${NOPAD_FUZZ_ARGS:-} "${dirs[@]}" >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2 || true)
  if [ "$rc" -ne 0 ]; then
    failed+=("$t")
    echo "fuzz: $t FAILED (exit $rc); the report:" >&2
    grep -E -A40 '^==[0-9]+==|runtime error|deadly signal|Finding|uncaught|ALARM|out-of-memory' "$log" | head -80 >&2 || tail -40 "$log" >&2
    echo "fuzz: reproduce with $bin ${artifacts}<file> (files: $(ls "$artifacts" | tr '\n' ' '))" >&2
  fi
  summary+=("$(printf '%-14s %10s executions %8s/s  coverage %6s  %s' "$t" "${execs:-?}" "${rate:-?}" "${cov:-?}" \
    "$([ "$rc" -eq 0 ] && echo ok || echo FAILED)")")
done
echo "fuzz: $seconds s per target, $(($(date +%s) - t0)) s in all"
printf 'fuzz: %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: findings in ${failed[*]}: fix them and keep each input as a regression (docs/fuzzing.md)" >&2
  exit 1
fi
