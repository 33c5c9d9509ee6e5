// DatasetFolderWriter (dataset_folder.h).
#include "data/dataset_folder.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <climits>
#include <cstdio>

#include "core/error.h"
#include "core/io.h"
#include "data/shard.h"

namespace nopad {

namespace fs = std::filesystem;

namespace {

// This machine's name as it goes into a staging folder's name ('/' and '@' would break the name apart).
std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  std::string h(buf);
  for (char& c : h)
    if (c == '/' || c == '@') c = '_';
  return h;
}

// A process of that pid exists here (EPERM: it does, under another user).
bool process_alive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

}  // namespace

std::string staging_folder_name(std::string_view prefix) {
  return std::string(prefix) + std::to_string(::getpid()) + "@" + host_name();
}

size_t remove_dead_staging_folders(const fs::path& dir, std::string_view prefix) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) return 0;
  const std::string host = host_name();
  size_t removed = 0;
  for (const fs::directory_iterator end; it != end; it.increment(ec)) {
    if (ec) break;
    const std::string name = it->path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string_view rest = std::string_view(name).substr(prefix.size());
    const size_t at = rest.find('@');
    const std::string_view digits = rest.substr(0, at), folder_host = at == std::string_view::npos ? "" : rest.substr(at + 1);
    long long pid = 0;
    const auto [end_digits, parse_ec] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
    if (parse_ec != std::errc() || end_digits != digits.data() + digits.size() || pid <= 0 || pid > INT32_MAX) continue;
    if (at != std::string_view::npos && folder_host != host) continue;  // another machine's: its pid means nothing here
    if (pid == ::getpid() || process_alive(static_cast<pid_t>(pid))) continue;
    std::error_code rm_ec;
    if (!it->is_directory(rm_ec) || rm_ec) continue;
    uint64_t bytes = 0;
    for (fs::recursive_directory_iterator f(it->path(), rm_ec), fend; !rm_ec && f != fend; f.increment(rm_ec))
      if (f->is_regular_file(rm_ec)) bytes += f->file_size(rm_ec);
    fs::remove_all(it->path(), rm_ec);
    if (rm_ec) {
      std::fprintf(stderr, "nopad: cannot remove %s, left by process %lld, which is no longer running: %s\n",
                   it->path().c_str(), pid, rm_ec.message().c_str());
      continue;
    }
    std::fprintf(stderr,
                 "nopad: removed %s (%.1f MB), the staging folder of process %lld on this host, which is no longer "
                 "running (an interrupted nopad prepare or convert)\n",
                 it->path().c_str(), static_cast<double>(bytes) / 1e6, pid);
    ++removed;
  }
  return removed;
}

std::string shard_name(size_t index) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "shard_%05zu%s", index, kShardExtension);
  return buf;
}

DatasetFolderWriter::DatasetFolderWriter(const fs::path& dir, bool overwrite, const std::string& flag) : dir_(dir) {
  ensure_writable_dir(dir_);
  for (const auto& e : fs::directory_iterator(dir_))
    if (e.path().extension() == kShardExtension || e.path().filename() == "dataset.json") stale_.push_back(e.path());
  NOPAD_CHECK(stale_.empty() || overwrite, flag, " folder ", dir_.string(), " already holds a dataset (",
              stale_.empty() ? "" : stale_.front().filename().string(), "): pass --overwrite to replace it, or choose "
              "another ", flag);
  remove_dead_staging_folders(dir_, ".staging-");
  staging_ = dir_ / staging_folder_name(".staging-");
  fs::remove_all(staging_);
  fs::create_directories(staging_);
}

DatasetFolderWriter::~DatasetFolderWriter() {
  std::error_code ec;
  fs::remove_all(staging_, ec);
}

void DatasetFolderWriter::stage_file(const std::string& name, std::string_view contents) {
  write_file_atomic(staging_ / name, contents);
  staged_files_.push_back(name);
}

void DatasetFolderWriter::commit(size_t num_shards, const nlohmann::json& manifest) {
  if (!stale_.empty()) {
    fs::remove(dir_ / "dataset.json");
    fsync_dir(dir_);
    for (const fs::path& p : stale_) fs::remove(p);
  }
  for (size_t s = 0; s < num_shards; ++s) fs::rename(staged_shard(s), dir_ / shard_name(s));
  for (const std::string& name : staged_files_) fs::rename(staging_ / name, dir_ / name);
  fsync_dir(dir_);
  write_file_atomic(dir_ / "dataset.json", manifest.dump(2) + "\n");
}

}  // namespace nopad
