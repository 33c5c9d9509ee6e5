// nopad info: the build (version, backends) and the machine (cores, GPUs).
#include <cstdio>

#include "cli/command.h"
#include "core/threads.h"
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
  });
}

NOPAD_REGISTER_COMMAND("info", "the build and the machine: version, backends, CPU threads, GPUs", 90, setup);

}  // namespace
