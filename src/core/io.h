// File input/output with the guarantees a training system needs: whole-file reads with errors that name the file,
// read-only memory maps, and atomic writes (temporary name, fsync, rename, fsync of the folder) so that a crash
// never leaves a half-written file where a good one stood.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace nopad {

namespace fs = std::filesystem;

std::string read_file(const fs::path& path);

// Writes `path` atomically: bytes go to a temporary file beside it; commit() makes them durable and renames the
// temporary over `path`. Destroyed without commit() (an exception, a failed run), the temporary is removed and any
// existing `path` is untouched.
class AtomicWriter {
 public:
  explicit AtomicWriter(fs::path path);
  ~AtomicWriter();
  AtomicWriter(const AtomicWriter&) = delete;
  AtomicWriter& operator=(const AtomicWriter&) = delete;

  void write(const void* data, size_t size_bytes);
  void write(std::string_view s) { write(s.data(), s.size()); }
  uint64_t bytes_written() const { return bytes_written_; }
  void commit();
  const fs::path& path() const { return path_; }

 private:
  fs::path path_, tmp_path_;
  int fd_ = -1;
  uint64_t bytes_written_ = 0;
  bool committed_ = false;
};

// Writes a whole file atomically.
void write_file_atomic(const fs::path& path, std::string_view contents);

// Fsyncs a directory so that a rename inside it survives a crash.
void fsync_dir(const fs::path& dir);

// A read-only memory map of a whole file (an empty file maps to size 0, data nullptr).
class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const fs::path& path);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const fs::path& path() const { return path_; }

 private:
  void release();
  fs::path path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Creates `dir` (and parents) and proves it writable by creating and removing a probe file; throws a clear error
// otherwise. Used before long work so that an unwritable output is found at once, not after an hour.
void ensure_writable_dir(const fs::path& dir);

// Throws the error for a path that could not be read (`what` names its role: "input", "dataset folder"): a symbolic
// link that loops (ELOOP) is called that, anything else gives the system's reason.
// True when `ec` (from fs::status and the like) only says that the path is not there.
inline bool is_missing_path_error(std::error_code ec) {
  return ec == std::errc::no_such_file_or_directory || ec == std::errc::not_a_directory;
}
[[noreturn]] void fail_unreadable_path(std::string_view what, const fs::path& path, std::error_code ec);

}  // namespace nopad
