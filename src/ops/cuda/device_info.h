// What the CUDA runtime reports about the GPUs (name, compute capability, memory, multiprocessors), for
// `nopad info` and run logs. Only built with the CUDA backend.
#pragma once
#include <string>

namespace nopad::cuda {
std::string device_summary();
}
