// MlLog (train/mllog.h): the exact ":::MLLOG" line format, lines logged before open() written once it is called (and
// nothing written when it never is), appending to an existing log, a disabled log writing nothing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "train/mllog.h"

namespace nopad {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> lines_of(const fs::path& p) {
  std::vector<std::string> out;
  std::ifstream in(p);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

fs::path temp_dir() {
  const fs::path d = fs::temp_directory_path() / ("nopad-mllog-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

TEST(MlLog, LineFormat) {
  EXPECT_EQ(MlLog::format(1700000000123, "POINT_IN_TIME", "eval_accuracy", 0.75,
                          {{"epoch_num", 150000}, {"file", "src/train/trainer.cpp"}, {"lineno", 7}}),
            ":::MLLOG {\"namespace\":\"\",\"time_ms\":1700000000123,\"event_type\":\"POINT_IN_TIME\",\"key\":"
            "\"eval_accuracy\",\"value\":0.75,\"metadata\":{\"epoch_num\":150000,\"file\":\"src/train/trainer.cpp\","
            "\"lineno\":7}}");
}

TEST(MlLog, PendingUntilOpenThenAppended) {
  const fs::path dir = temp_dir();
  {
    MlLog log;
    log.point("cache_clear", true);
    log.start("init_start");
    EXPECT_FALSE(fs::exists(dir / "mllog.txt")) << "nothing is written before open()";
    log.open(dir / "mllog.txt", false);
    log.end("init_stop");
  }
  std::vector<std::string> l = lines_of(dir / "mllog.txt");
  ASSERT_EQ(l.size(), 3u);
  EXPECT_NE(l[0].find("\"key\":\"cache_clear\",\"value\":true"), std::string::npos) << l[0];
  EXPECT_NE(l[1].find("\"event_type\":\"INTERVAL_START\",\"key\":\"init_start\""), std::string::npos) << l[1];
  EXPECT_NE(l[2].find("\"event_type\":\"INTERVAL_END\",\"key\":\"init_stop\""), std::string::npos) << l[2];
  EXPECT_NE(l[2].find("\"file\":\"tests/test_mllog.cpp\""), std::string::npos) << "metadata names the logging line: " << l[2];
  {
    MlLog log;  // a resumed run appends
    log.open(dir / "mllog.txt", false);
    log.start("run_start");
  }
  l = lines_of(dir / "mllog.txt");
  ASSERT_EQ(l.size(), 4u);
  EXPECT_NE(l[3].find("run_start"), std::string::npos);
  {
    MlLog log;
    log.disable();
    log.point("seed", 1);
    log.open(dir / "other.txt", false);
    log.point("seed", 2);
  }
  EXPECT_FALSE(fs::exists(dir / "other.txt")) << "a disabled log (ranks other than 0) creates nothing";
  EXPECT_THROW(MlLog().open(dir / "missing" / "mllog.txt", false), Error);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace nopad
