// Replays every fuzz seed (tests/fuzz/corpus/TARGET) and every input a fuzzer once crashed on
// (tests/fuzz/regressions/TARGET) through the same bodies the libFuzzer targets run, compiled here without libFuzzer
// or sanitizers, so that the regressions run in every test build (docs/fuzzing.md). A body refuses bad input with
// nopad::Error and catches that itself: any exception reaching this test is a finding.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz/fuzz_targets.h"

namespace fs = std::filesystem;

namespace nopad::fuzz {
// Test names and failure messages show the target's name.
inline void PrintTo(const Target& t, std::ostream* os) { *os << t.name; }
}  // namespace nopad::fuzz

namespace {

std::vector<fs::path> inputs_under(const fs::path& dir) {
  std::vector<fs::path> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file() && e.path().filename() != "README.md") out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

class FuzzInputs : public ::testing::TestWithParam<nopad::fuzz::Target> {};

void replay(const nopad::fuzz::Target& target, const std::vector<fs::path>& files) {
  for (const fs::path& f : files) {
    SCOPED_TRACE(f.string());
    const std::string bytes = slurp(f);
    try {
      target.run(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    } catch (const std::exception& e) {
      ADD_FAILURE() << "fuzz target " << target.name << " on " << f.string() << ": " << e.what();
    }
  }
}

TEST_P(FuzzInputs, SeedCorpusRunsClean) {
  const fs::path dir = fs::path(NOPAD_SOURCE_DIR) / "tests/fuzz/corpus" / std::string(GetParam().name);
  const std::vector<fs::path> files = inputs_under(dir);
  ASSERT_GE(files.size(), 3u) << dir << " should hold the target's seeds (python3 scripts/fuzz-corpus.py)";
  replay(GetParam(), files);
}

TEST_P(FuzzInputs, RegressionsRunClean) {
  replay(GetParam(), inputs_under(fs::path(NOPAD_SOURCE_DIR) / "tests/fuzz/regressions" / std::string(GetParam().name)));
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzInputs, ::testing::ValuesIn(nopad::fuzz::kTargets),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
