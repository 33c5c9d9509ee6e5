// Sizing work to memory: the host memory available (meminfo and cgroup limits, read from fake trees), the bytes a
// BertModel will allocate (held equal to what it does allocate), and the CPU batch check nopad eval runs before it
// allocates anything.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "core/error.h"
#include "core/host_memory.h"
#include "core/io.h"
#include "model/bert.h"
#include "ops/cpu/cpu_backend.h"
#include "test_util.h"
#include "train/engine.h"

namespace nopad {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kGiB = uint64_t{1} << 30;

void put(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  write_file_atomic(p, text);
}

TEST(HostMemory, MeminfoAndCgroupLimits) {
  test::TempDir dir("mem");
  const fs::path proc = dir / "proc", cg = dir / "cgroup";
  put(proc / "meminfo", "MemTotal:       24683784 kB\nMemFree:  100 kB\nMemAvailable:   20971520 kB\n"
                        "HugePages_Total:       0\nSwapFree:        1048576 kB\n");
  put(proc / "self/cgroup", "0::/\n");
  HostMemory m = host_memory_available(false, proc, cg);
  EXPECT_EQ(m.available_bytes, 20 * kGiB);
  EXPECT_EQ(m.limited_by, "MemAvailable in /proc/meminfo");
  EXPECT_EQ(host_memory_available(true, proc, cg).available_bytes, 21 * kGiB);

  // cgroup v2: a job's limit, less what it uses that is not reclaimable page cache; the tightest ancestor wins.
  put(proc / "self/cgroup", "0::/slurm/job_7/step_0\n");
  put(cg / "slurm/job_7/memory.max", std::to_string(8 * kGiB) + "\n");
  put(cg / "slurm/job_7/memory.current", std::to_string(3 * kGiB) + "\n");
  put(cg / "slurm/job_7/memory.stat", "anon 1\ninactive_file " + std::to_string(kGiB) + "\nactive_file 5\n");
  put(cg / "slurm/job_7/step_0/memory.max", "max\n");
  put(cg / "slurm/job_7/step_0/memory.current", "12\n");
  m = host_memory_available(false, proc, cg);
  EXPECT_EQ(m.available_bytes, 6 * kGiB);
  EXPECT_NE(m.limited_by.find("cgroup /slurm/job_7, 8.0 GiB with 2.0 GiB in use"), std::string::npos) << m.limited_by;
  put(cg / "slurm/memory.max", std::to_string(5 * kGiB) + "\n");
  put(cg / "slurm/memory.current", std::to_string(kGiB) + "\n");
  EXPECT_EQ(host_memory_available(false, proc, cg).available_bytes, 4 * kGiB);

  // cgroup v1 (the memory controller's own hierarchy); "no limit" is a huge number there.
  put(proc / "self/cgroup", "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n");
  put(cg / "memory/docker/abc/memory.limit_in_bytes", std::to_string(2 * kGiB) + "\n");
  put(cg / "memory/docker/abc/memory.usage_in_bytes", std::to_string(kGiB) + "\n");
  put(cg / "memory/docker/abc/memory.stat", "inactive_file 7\ntotal_inactive_file " + std::to_string(kGiB / 2) + "\n");
  put(cg / "memory/memory.limit_in_bytes", "9223372036854771712\n");
  put(cg / "memory/memory.usage_in_bytes", "1\n");
  m = host_memory_available(false, proc, cg);
  EXPECT_EQ(m.available_bytes, kGiB + kGiB / 2);
  EXPECT_NE(m.limited_by.find("cgroup /docker/abc"), std::string::npos) << m.limited_by;

  // The real machine: something positive.
  EXPECT_GT(host_memory_available().available_bytes, 0u);
  EXPECT_EQ(format_bytes(3 * kGiB / 2), "1.5 GiB");
  EXPECT_EQ(format_bytes(640 << 20), "640.0 MiB");
}

BertConfig small_config() {
  BertConfig c;
  c.hidden_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.intermediate_size = 48;
  c.vocab_size = 101;
  c.max_position_embeddings = 64;
  return c;
}

// planned_bytes mirrors the constructor's allocations: a buffer added to one and not the other fails here.
TEST(HostMemory, PlannedBytesEqualWhatTheModelAllocates) {
  const BertConfig c = small_config();
  ops::CpuBackend<ops::CpuF32> be(1);
  ops::CpuBackend<ops::CpuF64> be64(1);
  struct Cap {
    int32_t tokens, seqs, masked;
  };
  for (const Cap cap : {Cap{64, 1, 10}, Cap{640, 10, 100}, Cap{100, 50, 0}, Cap{8, 4, 20}}) {
    SCOPED_TRACE(std::to_string(cap.tokens) + " tokens, " + std::to_string(cap.seqs) + " seqs");
    const BertModel<ops::CpuF32> m(c, be, cap.tokens, cap.seqs, cap.masked);
    EXPECT_EQ(BertModel<ops::CpuF32>::planned_bytes(c, cap.tokens, cap.seqs, cap.masked, c.vocab_size),
              m.allocated_bytes());
    const BertModel<ops::CpuF64> m64(c, be64, cap.tokens, cap.seqs, cap.masked);
    EXPECT_EQ(BertModel<ops::CpuF64>::planned_bytes(c, cap.tokens, cap.seqs, cap.masked, c.vocab_size),
              m64.allocated_bytes());
  }
}

TEST(HostMemory, CpuBatchCheckNamesTheNeedAndTheBatchThatFits) {
  EngineOptions o;
  o.config = BertConfig::from_file((test::source_dir() / "data/configs/bert-tiny.json").string());
  const int64_t len = 128, masked = 20;
  const HostMemory plenty{1024 * kGiB, "test"}, one{kGiB, "a test's limit"}, tiny{64 << 20, "a test's limit"};
  EXPECT_NO_THROW(check_cpu_batch_fits(o, 10000, 10000, len, masked, plenty));
  const std::string msg = test::error_of([&] { check_cpu_batch_fits(o, 10000, 10000, len, masked, one); });
  EXPECT_NE(msg.find("--batch 10000 needs about "), std::string::npos) << msg;
  EXPECT_NE(msg.find("but 1.0 GiB is available (a test's limit): use --batch "), std::string::npos) << msg;
  const size_t at = msg.find("use --batch ");
  ASSERT_NE(at, std::string::npos) << msg;
  const int32_t fits = std::stoi(msg.substr(at + 12));
  ASSERT_GT(fits, 0);
  EXPECT_NO_THROW(check_cpu_batch_fits(o, fits, fits, len, masked, one));
  EXPECT_THROW(check_cpu_batch_fits(o, fits + 1, fits + 1, len, masked, one), Error);
  // The estimate is what a CPU engine of that batch takes, at least.
  EXPECT_GE(cpu_engine_bytes(with_batch(o, 64, len, masked)),
            BertModel<ops::CpuF32>::planned_bytes(o.config, 64 * len, 64, 64 * masked, o.config.vocab_size));
  NOPAD_EXPECT_ERROR_HAS(check_cpu_batch_fits(o, 32, 32, len, masked, tiny), "even --batch 1 needs");
}

}  // namespace
}  // namespace nopad
