// The GPU side of `nopad bench attention` (train/attention_bench.h) behind plain C++ types. Only built with the CUDA
// backend: include it under #ifdef NOPAD_HAVE_CUDA.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "train/attention_bench.h"

namespace nopad::cuda {

// Times every schedule and dropout of `o` on each batch of lengths; returns one JSON line per measurement and prints a
// table on stderr. Each schedule's outputs are checked against the single launch's (ctx bitwise) before timing.
std::vector<std::string> run_attention_bench_gpu(const AttentionBenchOptions& o,
                                                 const std::vector<std::vector<int32_t>>& batches);

}  // namespace nopad::cuda
