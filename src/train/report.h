// A run at a glance: `nopad report RUN_DIR` reads what a training run wrote (metrics.jsonl, and mllog.txt when there)
// and writes a short summary (report.md, also returned as text) and three SVG plots: the training loss and the eval
// masked-LM accuracy against samples, and the throughput against steps.
//
// Contract: read_run() throws naming the file and line on a missing metrics.jsonl or a line that is not a JSON object;
// write_report() writes each output atomically (a report folder is never half-written over a good one). The plots
// are self-contained SVG 1.1 (no scripts, no external fonts), so any browser or image viewer shows them.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/io.h"

namespace nopad {

struct RunPoint {  // one metrics.jsonl training line
  int64_t step = 0;
  uint64_t samples = 0;
  double loss = 0, mlm_accuracy = 0, seq_per_s = 0, elapsed_s = 0;
  bool finite = true;  // loss was a number (null in the log when it was not finite)
};
struct EvalPoint {  // one metrics.jsonl eval line
  int64_t step = 0;
  uint64_t samples = 0;
  double mlm_accuracy = 0, nsp_accuracy = 0, loss = 0;
};
struct RunRecord {
  std::vector<RunPoint> steps;
  std::vector<EvalPoint> evals;
  std::optional<double> run_minutes;  // mllog run_start -> run_stop
  std::string run_status;             // mllog run_stop's status ("" without an mllog)
};

RunRecord read_run(const fs::path& run_dir);

// The summary as Markdown: steps, samples, time, losses, eval accuracies, throughput, the MLPerf status.
std::string report_markdown(const RunRecord& run, const fs::path& run_dir);

// A line plot: each series a polyline of (x, y) points (x ascending), axes with round ticks, a legend.
struct PlotSeries {
  std::string name;
  std::vector<std::pair<double, double>> points;
};
std::string svg_line_plot(const std::string& title, const std::string& x_label, const std::string& y_label,
                          const std::vector<PlotSeries>& series);

// Writes report.md, loss.svg, accuracy.svg, throughput.svg into out_dir (created); returns the summary text.
std::string write_report(const fs::path& run_dir, const fs::path& out_dir);

}  // namespace nopad
