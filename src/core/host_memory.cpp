// Available host memory from /proc/meminfo and the cgroup memory limits (see host_memory.h).
#include "core/host_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string_view>
#include <vector>

namespace nopad {

namespace fs = std::filesystem;

namespace {

constexpr uint64_t kNoLimit = UINT64_MAX;

// The first line of `path` as an unsigned number; false when missing, unreadable or not a number ("max").
bool read_number(const fs::path& path, uint64_t* out) {
  std::ifstream in(path);
  std::string s;
  if (!(in >> s) || s.empty() || s.find_first_not_of("0123456789") != std::string::npos) return false;
  try {
    *out = std::stoull(s);
  } catch (...) {
    return false;
  }
  return true;
}

// The value of `key` in a "key value" file (memory.stat), or 0.
uint64_t stat_value(const fs::path& path, std::string_view key) {
  std::ifstream in(path);
  std::string k;
  uint64_t v = 0;
  while (in >> k >> v)
    if (k == key) return v;
  return 0;
}

// Headroom under the memory limit of cgroup `rel` (a path such as "/slurm/job_7", v2 when `v2`) and every cgroup
// above it that is visible under `root`; the tightest one wins.
void cgroup_headroom(const fs::path& root, std::string rel, bool v2, HostMemory* best) {
  const char* limit_file = v2 ? "memory.max" : "memory.limit_in_bytes";
  const char* usage_file = v2 ? "memory.current" : "memory.usage_in_bytes";
  const char* inactive_key = v2 ? "inactive_file" : "total_inactive_file";
  for (;;) {
    const fs::path dir = root / fs::path(rel).relative_path();
    uint64_t limit = 0, usage = 0;
    // v1 reports "no limit" as a huge page-rounded number.
    if (read_number(dir / limit_file, &limit) && limit < (uint64_t{1} << 62) && read_number(dir / usage_file, &usage)) {
      const uint64_t inactive = stat_value(dir / "memory.stat", inactive_key);
      const uint64_t used = usage > inactive ? usage - inactive : 0;
      const uint64_t headroom = limit > used ? limit - used : 0;
      if (headroom < best->available_bytes) {
        best->available_bytes = headroom;
        best->limited_by = "the memory limit of cgroup " + (rel.empty() ? std::string("/") : rel) + ", " +
                           format_bytes(limit) + " with " + format_bytes(used) + " in use";
      }
    }
    if (rel.empty() || rel == "/") break;
    const size_t slash = rel.rfind('/');
    rel = slash == 0 || slash == std::string::npos ? "/" : rel.substr(0, slash);
  }
}

}  // namespace

std::string format_bytes(uint64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f GiB", b / (1024.0 * 1024 * 1024));
  else
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  return buf;
}

HostMemory host_memory_available(bool with_swap, const fs::path& proc, const fs::path& cgroup) {
  HostMemory m;
  m.available_bytes = kNoLimit;
  {
    std::ifstream in(proc / "meminfo");
    std::string key, unit;
    uint64_t kib = 0, available = 0, swap_free = 0;
    bool have = false;
    while (in >> key >> kib) {
      std::getline(in, unit);
      if (key == "MemAvailable:") available = kib * 1024, have = true;
      if (key == "SwapFree:") swap_free = kib * 1024;
    }
    if (have) {
      m.available_bytes = available + (with_swap ? swap_free : 0);
      m.limited_by = with_swap ? "MemAvailable + SwapFree in /proc/meminfo" : "MemAvailable in /proc/meminfo";
    } else {
      const long pages = ::sysconf(_SC_AVPHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
      if (pages > 0 && page > 0) {
        m.available_bytes = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
        m.limited_by = "the free physical pages (sysconf)";
      }
    }
  }
  // /proc/self/cgroup: "0::/path" (v2), "N:memory:/path" or "N:cpu,memory:/path" (v1).
  std::ifstream in(proc / "self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), rel = line.substr(b + 1);
    if (controllers.empty()) {
      cgroup_headroom(cgroup, rel, true, &m);
      continue;
    }
    std::stringstream ss(controllers);
    std::string c;
    while (std::getline(ss, c, ','))
      if (c == "memory") cgroup_headroom(cgroup / "memory", rel, false, &m);
  }
  if (m.available_bytes == kNoLimit) m.limited_by = "nothing (no limit could be read)";
  return m;
}

}  // namespace nopad
