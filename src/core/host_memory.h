// How much host memory this process can still take before the kernel's OOM killer (or a cgroup's, under Slurm,
// Kubernetes or Docker) ends it: so that a command can refuse work that cannot fit, with numbers, instead of being
// killed without a word.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

namespace nopad {

struct HostMemory {
  uint64_t available_bytes = 0;  // the smallest of the limits below
  std::string limited_by;        // what set it, for messages: "MemAvailable in /proc/meminfo", "cgroup /job_7 ..."
};

// The memory available: MemAvailable from PROC/meminfo (plus SwapFree when with_swap), and, where this process's
// cgroup (v2 or v1, from PROC/self/cgroup) or one above it has a memory limit under CGROUP, that limit less what the
// cgroup uses (reclaimable page cache, inactive_file, not counted as used). Falls back to sysconf's available
// physical pages when meminfo cannot be read. The roots are parameters for tests.
HostMemory host_memory_available(bool with_swap = false, const std::filesystem::path& proc = "/proc",
                                 const std::filesystem::path& cgroup = "/sys/fs/cgroup");

// "21.3 GiB", "640.0 MiB": bytes for messages.
std::string format_bytes(uint64_t bytes);

}  // namespace nopad
