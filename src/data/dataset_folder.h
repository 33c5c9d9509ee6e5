// Writing a dataset folder (nopad prepare, nopad convert) so that it always holds one complete dataset or none: the
// new shards go into a hidden staging folder inside it, and commit() replaces what was there manifest first (a folder
// without dataset.json is incomplete, never a mix of two datasets), then the old shards, then moves the new shards in
// and writes the new dataset.json last. Until commit() an existing dataset stays as it was; a writer destroyed without
// commit() (an error) removes its staging folder.
#pragma once
#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace nopad {

std::string shard_name(size_t index);  // shard_00000.nopad, ...

class DatasetFolderWriter {
 public:
  // Creates `dir` if needed and checks that it is writable and holds no dataset (shards or dataset.json), unless
  // `overwrite`; `flag` names the folder's option in the refusal ("--output"). Makes the staging folder.
  DatasetFolderWriter(const std::filesystem::path& dir, bool overwrite, const std::string& flag);
  ~DatasetFolderWriter();
  DatasetFolderWriter(const DatasetFolderWriter&) = delete;
  DatasetFolderWriter& operator=(const DatasetFolderWriter&) = delete;

  const std::filesystem::path& dir() const { return dir_; }
  // Where shard `index` is to be written before commit().
  std::filesystem::path staged_shard(size_t index) const { return staging_ / shard_name(index); }
  // Stages a file that belongs with the shards (the vocabulary, vocab.txt): moved in by commit(), replacing the old
  // dataset's file of that name.
  void stage_file(const std::string& name, std::string_view contents);
  // Replaces the folder's dataset by staged shards 0 .. num_shards-1, the staged files and `manifest`
  // (dataset.json).
  void commit(size_t num_shards, const nlohmann::json& manifest);

 private:
  std::filesystem::path dir_, staging_;
  std::vector<std::filesystem::path> stale_;  // the existing dataset's files
  std::vector<std::string> staged_files_;

};

}  // namespace nopad
