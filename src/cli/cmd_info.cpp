// nopad info: the build (version, backends, MPI) and the machine (cores, GPUs), and this process's rank.
#include <cstdio>

#include "cli/command.h"
#include "core/threads.h"
#include "dist/comm.h"
#include "dist/launch.h"
#ifdef NOPAD_HAVE_CUDA
#include "ops/cuda/device_info.h"
#endif

namespace {

void setup(CLI::App& sub) {
  sub.callback([] {
    std::printf("nopad %s\n", NOPAD_VERSION);
    std::printf("cpu: %d hardware threads\n", nopad::hardware_threads());
#ifdef NOPAD_HAVE_CUDA
    std::printf("cuda backend: built\n%s\n", nopad::cuda::device_summary().c_str());
#else
    std::printf("cuda backend: not built (nvcc was not found at configure time)\n");
#endif
    std::printf("mpi: %s; this process: %s\n",
                nopad::dist::mpi_built() ? "built (data-parallel jobs under mpirun/srun)"
                                         : "not built (no MPI at configure time: one process only)",
                nopad::dist::describe(nopad::dist::detect_rank_info()).c_str());
  });
}

NOPAD_REGISTER_COMMAND("info", "the build and the machine: version, backends, CPU threads, GPUs", 90, setup);

}  // namespace
