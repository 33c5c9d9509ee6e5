// What the fuzz bodies share: a scratch folder for the readers that take a path, and the check that turns a broken
// invariant into a finding. A body's contract: nopad::Error is how bad input is refused; any other exception, a crash,
// a sanitizer report or a timeout is a finding. The bodies are compiled into the libFuzzer targets (fuzz_*.cpp) and
// into nopad_tests (tests/test_fuzz_regressions.cpp), which replays every seed and regression input.
#pragma once
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

namespace nopad::fuzz {

// A broken invariant of an accepted input: not nopad::Error, so it is reported as a finding, never as a refusal.
struct Finding : std::logic_error {
  using std::logic_error::logic_error;
};

inline void require(bool ok, const char* what) {
  if (!ok) throw Finding(std::string("fuzz invariant broken: ") + what);
}

// TMPDIR/nopad-fuzz-PID, created on first use and removed when the process ends normally.
inline const std::filesystem::path& scratch_dir() {
  struct Dir {
    std::filesystem::path path;
    Dir() {
      path = std::filesystem::temp_directory_path() / ("nopad-fuzz-" + std::to_string(::getpid()));
      std::filesystem::create_directories(path);
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Dir dir;
  return dir.path;
}

inline void write_bytes(const std::filesystem::path& file, const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(file.c_str(), "wb");
  if (!f) throw std::runtime_error("fuzz: cannot create " + file.string());
  const size_t written = size ? std::fwrite(data, 1, size, f) : 0;
  const bool closed = std::fclose(f) == 0;
  if (written != size || !closed) throw std::runtime_error("fuzz: cannot write " + file.string());
}

}  // namespace nopad::fuzz
