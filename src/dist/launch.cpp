// Rank detection from the launcher's environment (see launch.h).
#include "dist/launch.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "core/error.h"
#include "core/threads.h"

namespace nopad::dist {
namespace {

// The integer value of variable `name`, or `fallback` when it is not set; a value that is not a whole number is an
// error naming the variable.
int int_var(const EnvLookup& env, const char* name, int fallback, bool* was_set = nullptr) {
  const char* v = env(name);
  if (was_set) *was_set = v != nullptr && *v != '\0';
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  NOPAD_CHECK(end != v && *end == '\0' && errno == 0 && x >= -1 && x <= 1 << 24, "environment variable ", name, "=\"",
              v, "\" is not a rank or size (a whole number): fix the launcher's settings");
  return static_cast<int>(x);
}

// A true/false variable (True/False, 1/0 in any case; unset or empty is false); anything else is an error naming it.
bool bool_var(const EnvLookup& env, const char* name) {
  const char* v = env(name);
  if (v == nullptr || *v == '\0') return false;
  std::string s(v);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "true" || s == "1") return true;
  if (s == "false" || s == "0") return false;
  fail("environment variable ", name, "=\"", v, "\" is not True/False or 1/0: fix the launcher's settings");
}

struct Family {
  const char* launcher;
  const char *rank, *size, *local_rank, *local_size;
};
constexpr Family kFamilies[] = {
    {"mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"mpi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
};

}  // namespace

RankInfo detect_rank_info(const EnvLookup& env) {
  RankInfo info;
  for (const Family& f : kFamilies) {
    bool has_rank = false, has_size = false;
    const int rank = int_var(env, f.rank, 0, &has_rank);
    const int size = int_var(env, f.size, 1, &has_size);
    if (!has_rank || !has_size) continue;
    NOPAD_CHECK(size >= 1, f.size, "=", size, ": the world size must be at least 1");
    NOPAD_CHECK(rank >= 0 && rank < size, f.rank, "=", rank, " is outside [0, ", f.size, "=", size,
                "): fix the launcher's settings");
    info.rank = rank;
    info.world_size = size;
    info.launcher = f.launcher;
    bool has_local = false;
    info.local_rank = int_var(env, f.local_rank, 0, &has_local);
    NOPAD_CHECK(info.local_rank >= 0, f.local_rank, " must not be negative");
    // SLURM_NTASKS_PER_NODE may be a list ("4(x2),3"); only a plain number is taken as the local size.
    const char* ls = env(f.local_size);
    info.local_size = 0;
    if (ls != nullptr && *ls != '\0') {
      char* end = nullptr;
      const long x = std::strtol(ls, &end, 10);
      if (end != ls && *end == '\0' && x >= 1) info.local_size = static_cast<int>(x);
    }
    if (!has_local) info.local_rank = 0;
    if (info.local_size > 0)
      NOPAD_CHECK(info.local_rank < info.local_size, f.local_rank, "=", info.local_rank, " is outside [0, ",
                  f.local_size, "=", info.local_size, ")");
    if (info.launcher == std::string("torchrun")) {
      const char* addr = env("MASTER_ADDR");
      info.master_addr = addr ? addr : "";
      bool has_port = false;
      info.master_port = int_var(env, "MASTER_PORT", 0, &has_port);
      NOPAD_CHECK(size == 1 || (!info.master_addr.empty() && has_port && info.master_port > 0 &&
                                info.master_port < 65536),
                  "RANK/WORLD_SIZE are set (world size ", size, ") but MASTER_ADDR/MASTER_PORT are not a host and a "
                  "port: set both (torchrun does) or launch with mpirun/srun");
      // torchrun >= 2.4 shares its rendezvous TCPStore with the workers: MASTER_PORT is then already bound.
      info.agent_store = bool_var(env, "TORCHELASTIC_USE_AGENT_STORE");
      const char* run_id = env("TORCHELASTIC_RUN_ID");
      info.run_id = run_id != nullptr && *run_id != '\0' ? run_id : "none";
      info.restart_count = int_var(env, "TORCHELASTIC_RESTART_COUNT", 0);
      NOPAD_CHECK(info.restart_count >= 0, "TORCHELASTIC_RESTART_COUNT must not be negative");
    }
    return info;
  }
  return info;  // single process
}

RankInfo detect_rank_info() {
  return detect_rank_info([](const char* name) -> const char* { return std::getenv(name); });
}

std::string describe(const RankInfo& info) {
  std::string s = "rank " + std::to_string(info.rank) + " of " + std::to_string(info.world_size);
  s += " (local " + std::to_string(info.local_rank);
  if (info.local_size > 0) s += " of " + std::to_string(info.local_size);
  s += ", " + info.launcher + ")";
  return s;
}

int default_cpu_threads(const RankInfo& info, int cores) {
  const int local = info.local_size > 0 ? info.local_size : 1;
  return std::max(1, cores / local);
}

int default_cpu_threads() { return default_cpu_threads(detect_rank_info(), hardware_threads()); }

}  // namespace nopad::dist
