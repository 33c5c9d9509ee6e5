// DatasetFolderWriter's staging folders: named PREFIX<pid>@<host>; those of dead processes on this host (and those
// named without a host, as nopad named them before) are removed by the next writer of the folder, with a message;
// a live process's, another host's and this process's own are left alone.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "core/io.h"
#include "data/dataset_folder.h"
#include "test_util.h"

namespace nopad {
namespace {

namespace fs = std::filesystem;

// The pid of a process that has exited and been reaped (so that no process has it, barring reuse).
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

std::string this_host() {
  const std::string mine = staging_folder_name("x-");
  return mine.substr(mine.find('@') + 1);
}

void make_staging(const fs::path& dir, const std::string& name) {
  fs::create_directories(dir / name);
  write_file_atomic(dir / name / "shard_00000.nopad", std::string(1000, 'x'));
}

TEST(DatasetFolder, StagingFoldersOfDeadProcessesAreRemoved) {
  test::TempDir dir("staging");
  const std::string host = this_host();
  const pid_t dead = dead_pid(), alive = ::getppid();
  const std::string dead_here = ".staging-" + std::to_string(dead) + "@" + host;
  const std::string dead_unnamed_host = ".staging-" + std::to_string(dead);  // an older nopad's name
  const std::string dead_elsewhere = ".staging-" + std::to_string(dead) + "@another-host";
  const std::string alive_here = ".staging-" + std::to_string(alive) + "@" + host;
  const std::string alive_unnamed_host = ".staging-1";  // pid 1 always runs
  const std::string not_staging = ".staging-12ab";
  for (const std::string& n : {dead_here, dead_unnamed_host, dead_elsewhere, alive_here, alive_unnamed_host, not_staging})
    make_staging(dir.path(), n);

  testing::internal::CaptureStderr();
  {
    DatasetFolderWriter w(dir.path(), false, "--output");
    EXPECT_EQ(staging_folder_name(".staging-"), ".staging-" + std::to_string(::getpid()) + "@" + host);
    EXPECT_TRUE(fs::is_directory(dir / staging_folder_name(".staging-")));
  }
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(fs::exists(dir / dead_here));
  EXPECT_FALSE(fs::exists(dir / dead_unnamed_host));
  EXPECT_TRUE(fs::exists(dir / dead_elsewhere)) << "another host's staging folder was removed";
  EXPECT_TRUE(fs::exists(dir / alive_here)) << "a live process's staging folder was removed";
  EXPECT_TRUE(fs::exists(dir / alive_unnamed_host));
  EXPECT_TRUE(fs::exists(dir / not_staging));
  EXPECT_FALSE(fs::exists(dir / staging_folder_name(".staging-"))) << "the writer's own staging folder is left";
  EXPECT_NE(said.find("removed " + (dir / dead_here).string()), std::string::npos) << said;
  EXPECT_NE(said.find("removed " + (dir / dead_unnamed_host).string()), std::string::npos) << said;
  EXPECT_NE(said.find("process " + std::to_string(dead) + " on this host, which is no longer running"),
            std::string::npos) << said;
  EXPECT_EQ(said.find(alive_here), std::string::npos) << said;

  // The TensorFlow-checkpoint conversion's staging folders, by the same rule.
  make_staging(dir.path(), ".convert-staging-" + std::to_string(dead) + "@" + host);
  make_staging(dir.path(), ".convert-staging-" + std::to_string(alive) + "@" + host);
  testing::internal::CaptureStderr();
  EXPECT_EQ(remove_dead_staging_folders(dir.path(), ".convert-staging-"), 1u);
  testing::internal::GetCapturedStderr();
  EXPECT_FALSE(fs::exists(dir / (".convert-staging-" + std::to_string(dead) + "@" + host)));
  EXPECT_TRUE(fs::exists(dir / (".convert-staging-" + std::to_string(alive) + "@" + host)));
  EXPECT_EQ(remove_dead_staging_folders(dir / "missing", ".staging-"), 0u);
}

}  // namespace
}  // namespace nopad
