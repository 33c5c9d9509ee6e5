#include "core/io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "core/error.h"

namespace nopad {

std::string read_file(const fs::path& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) fail(path.string(), " is a folder, where a file was expected");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open ", path.string(), ": ", std::strerror(errno));
  std::string data;
  in.seekg(0, std::ios::end);
  const auto size = in.tellg();
  if (size < 0) fail("cannot read ", path.string(), " (not a regular file?)");
  data.resize(static_cast<size_t>(size));
  in.seekg(0);
  in.read(data.data(), size);
  if (!in) fail("error reading ", path.string());
  return data;
}

AtomicWriter::AtomicWriter(fs::path path) : path_(std::move(path)) {
  tmp_path_ = path_;
  tmp_path_ += ".tmp." + std::to_string(::getpid());
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0)
    fail("cannot create ", tmp_path_.string(), ": ", std::strerror(errno),
         " (check that the folder exists and is writable)");
}

AtomicWriter::~AtomicWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_path_.c_str());
}

void AtomicWriter::write(const void* data, size_t size_bytes) {
  NOPAD_CHECK(fd_ >= 0 && !committed_, "write to ", path_.string(), " after it was committed");
  const auto* p = static_cast<const char*>(data);
  while (size_bytes > 0) {
    const ssize_t n = ::write(fd_, p, size_bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("cannot write ", tmp_path_.string(), ": ", std::strerror(errno));
    }
    p += n;
    size_bytes -= static_cast<size_t>(n);
    bytes_written_ += static_cast<uint64_t>(n);
  }
}

void AtomicWriter::commit() {
  NOPAD_CHECK(fd_ >= 0 && !committed_, "commit of ", path_.string(), " twice");
  if (::fsync(fd_) != 0) fail("cannot fsync ", tmp_path_.string(), ": ", std::strerror(errno));
  if (::close(fd_) != 0) {
    fd_ = -1;
    fail("cannot close ", tmp_path_.string(), ": ", std::strerror(errno));
  }
  fd_ = -1;
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0)
    fail("cannot rename ", tmp_path_.string(), " to ", path_.string(), ": ", std::strerror(errno));
  committed_ = true;
  fsync_dir(path_.has_parent_path() ? path_.parent_path() : fs::path("."));
}

void write_file_atomic(const fs::path& path, std::string_view contents) {
  AtomicWriter w(path);
  w.write(contents);
  w.commit();
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: some file systems do not allow opening folders
  ::fsync(fd);
  ::close(fd);
}

MappedFile::MappedFile(const fs::path& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open ", path.string(), ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail("cannot stat ", path.string(), ": ", std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path.string(), " is not a regular file");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      fail("cannot map ", path.string(), ": ", std::strerror(errno));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() { release(); }

void MappedFile::release() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

void ensure_writable_dir(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("cannot create folder ", dir.string(), ": ", ec.message());
  const fs::path probe = dir / (".nopad-write-probe." + std::to_string(::getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("folder ", dir.string(), " is not writable: ", std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

void fail_unreadable_path(std::string_view what, const fs::path& path, std::error_code ec) {
  if (ec == std::errc::too_many_symbolic_link_levels)
    fail(what, " ", path.string(), " is a symbolic link that loops (it leads back to itself, or through more than 40 "
         "links): fix or remove the link, or give its target instead");
  fail("cannot read ", what, " ", path.string(), ": ", ec.message());
}

}  // namespace nopad
