#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "ops/cuda/device_info.h"

namespace nopad::cuda {

std::string device_summary() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return std::string("no CUDA device usable: ") + cudaGetErrorString(err);
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::string out = "CUDA driver " + std::to_string(driver / 1000) + "." + std::to_string(driver % 1000 / 10) +
                    ", runtime " + std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10) + ", " +
                    std::to_string(count) + " device(s)";
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) continue;
    char line[384];  // p.name is up to 256 characters
    std::snprintf(line, sizeof line, "\n  [%d] %s, sm_%d%d, %.1f GiB, %d SMs, L2 %.0f MB", d, p.name, p.major,
                  p.minor, static_cast<double>(p.totalGlobalMem) / (1 << 30), p.multiProcessorCount,
                  p.l2CacheSize / 1e6);
    out += line;
  }
  return out;
}

}  // namespace nopad::cuda
