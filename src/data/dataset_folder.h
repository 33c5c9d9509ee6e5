// Writing a dataset folder (nopad prepare, nopad convert) so that it always holds one complete dataset or none: the
// new shards go into a hidden staging folder inside it, and commit() replaces what was there manifest first (a folder
// without dataset.json is incomplete, never a mix of two datasets), then the old shards, then moves the new shards in
// and writes the new dataset.json last. Until commit() an existing dataset stays as it was; a writer destroyed without
// commit() (an error) removes its staging folder; those of writers that were killed are removed by the next writer of
// the folder (remove_dead_staging_folders).
#pragma once
#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace nopad {

std::string shard_name(size_t index);  // shard_00000.nopad, ...

// Staging folders are named PREFIX<pid>@<host> (".staging-4242@node07"), so that one left behind by a process that
// was killed can be told from one in use. This process's name for a staging folder with `prefix`:
std::string staging_folder_name(std::string_view prefix);
// Removes the folders PREFIX<pid>@<host> in `dir` whose process is gone: same host (or no host, as nopad named them
// before) and no live process of that pid. A staging folder of another host, or of a live pid, is left alone. Says
// what it removed on stderr; returns how many it removed. Errors while looking are ignored (nothing is removed then).
size_t remove_dead_staging_folders(const std::filesystem::path& dir, std::string_view prefix);

class DatasetFolderWriter {
 public:
  // Creates `dir` if needed and checks that it is writable and holds no dataset (shards or dataset.json), unless
  // `overwrite`; `flag` names the folder's option in the refusal ("--output"). Removes the staging folders of dead
  // processes (".staging-"), then makes its own.
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
