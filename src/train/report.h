// Runs at a glance: `nopad report RUN_DIR [RUN_DIR ...]` reads what training runs wrote (metrics.jsonl, and
// mllog.txt when there) and writes a short summary (report.md, also returned as text) and six SVG plots: the
// training loss, the eval masked-LM accuracy and the eval loss against samples; the throughput, the learning rate
// and the gradient norm against steps. Several runs are overlaid in each plot, one line per run, named by
// run_labels(); one run keeps its own series names (training and eval accuracy in one plot).
//
// Contract: read_run() throws naming the file and line on a missing metrics.jsonl or a line that is not a JSON object;
// write_report() reads every run before it writes anything, and writes each output atomically (a report folder is
// never half-written over a good one). The plots are self-contained SVG 1.1 (no scripts, no external fonts), so any
// browser or image viewer shows them; every text lies inside the canvas by svg_text_width()'s estimate, which is an
// upper bound of the common sans-serif fonts' widths (the canvas grows for long legends and labels).
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
  double lr = 0, grad_norm = 0;  // NaN where the line has no number
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

// The legend names of runs: each folder's name; names that two runs share get their parent folder's name in front,
// and names still equal after that a " (k)" suffix, k the run's place among them (1-based).
std::vector<std::string> run_labels(const std::vector<fs::path>& run_dirs);

// The summary as Markdown. One run: a two-column table (steps, samples, time, losses, eval accuracies, throughput,
// the MLPerf status). Several: one table row per run with the same figures.
std::string report_markdown(const RunRecord& run, const fs::path& run_dir);
std::string report_markdown(const std::vector<RunRecord>& runs, const std::vector<fs::path>& run_dirs);

// A line plot: each series a polyline of (x, y) points (x ascending; non-finite points left out), axes with round
// ticks, and a legend below the axes, one entry per series (" (no data)" after the name of an empty one).
struct PlotSeries {
  std::string name;
  std::vector<std::pair<double, double>> points;
};
std::string svg_line_plot(const std::string& title, const std::string& x_label, const std::string& y_label,
                          const std::vector<PlotSeries>& series);

// The width in pixels that `text` (UTF-8) takes at most in a sans-serif font of font_px pixels.
double svg_text_width(const std::string& text, double font_px);

// The files write_report() writes besides report.md.
const std::vector<std::string>& report_plot_files();

// Writes report.md and the plots into out_dir (created); returns the summary text.
std::string write_report(const fs::path& run_dir, const fs::path& out_dir);
std::string write_report(const std::vector<fs::path>& run_dirs, const fs::path& out_dir);

}  // namespace nopad
