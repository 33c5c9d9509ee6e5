// DatasetFolderWriter (dataset_folder.h).
#include "data/dataset_folder.h"

#include <unistd.h>

#include <cstdio>

#include "core/error.h"
#include "core/io.h"
#include "data/shard.h"

namespace nopad {

namespace fs = std::filesystem;

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
  staging_ = dir_ / (".staging-" + std::to_string(::getpid()));
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
