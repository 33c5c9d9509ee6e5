// nopad stats: length histogram, mean real length, padding waste, masked counts; --workload writes the
// `length masked_count` lines that the peer benchmarks read, in dataset order.
#include <cstdio>
#include <memory>
#include <string>

#include "cli/command.h"
#include "core/io.h"
#include "data/dataset.h"
#include "data/stats.h"

namespace {

struct StatsOptions {
  std::string dir, workload;
  bool json = false;
  uint32_t padded_length = 0, bin = 32;
  uint64_t workload_limit = 0;
};

void setup(CLI::App& sub) {
  auto opt = std::make_shared<StatsOptions>();
  sub.add_option("DIR", opt->dir, "dataset folder (or one .nopad shard)")->required();
  sub.add_option("--workload", opt->workload,
                 "write one `length masked_count` line per sequence, in dataset order, to this file");
  sub.add_option("--workload-limit", opt->workload_limit, "at most this many workload lines (0: all)");
  sub.add_flag("--json", opt->json, "print the statistics as one JSON object");
  sub.add_option("--padded-length", opt->padded_length,
                 "length a padded batch would use (default: the longest sequence in the data)");
  sub.add_option("--bin", opt->bin, "histogram bin width in tokens")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 20));
  sub.callback([opt] {
    const nopad::Dataset ds(opt->dir);
    const nopad::DatasetStats s = nopad::compute_stats(ds, opt->padded_length);
    if (opt->json)
      std::fputs(nopad::stats_json(s).c_str(), stdout);
    else
      std::fputs(nopad::format_stats(s, opt->bin).c_str(), stdout);
    if (!opt->workload.empty()) {
      std::string text;
      const uint64_t n = opt->workload_limit > 0 ? std::min(opt->workload_limit, ds.size()) : ds.size();
      text.reserve(n * 8);
      for (uint64_t i = 0; i < n; ++i) {
        text += std::to_string(ds.length(i));
        text += ' ';
        text += std::to_string(ds.num_masked(i));
        text += '\n';
      }
      nopad::write_file_atomic(opt->workload, text);
      std::fprintf(stderr, "wrote %llu workload lines to %s\n", static_cast<unsigned long long>(n),
                   opt->workload.c_str());
    }
  });
}

NOPAD_REGISTER_COMMAND("stats", "dataset statistics: lengths, padding waste, masked counts, workload files", 30,
                       setup);

}  // namespace
