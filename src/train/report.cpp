// The run report (see report.h).
#include "train/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace nopad {
namespace {

double number_or(const nlohmann::json& j, const char* key, double fallback, bool* was_number = nullptr) {
  const auto it = j.find(key);
  const bool ok = it != j.end() && it->is_number();
  if (was_number) *was_number = ok;
  return ok ? it->get<double>() : fallback;
}

// Round tick step: 1, 2 or 5 x 10^k giving about `want` intervals over span.
double tick_step(double span, int want) {
  if (!(span > 0)) return 1;
  const double raw = span / want, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
}

std::string fmt(double v) {
  char buf[32];
  if (v != 0 && (std::fabs(v) >= 1e6 || std::fabs(v) < 1e-3)) {
    std::snprintf(buf, sizeof buf, "%.3g", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.6g", v);
  }
  return buf;
}

std::string xml_escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// One metrics.jsonl line into r (nlohmann type errors for fields of the wrong type propagate to the caller).
void read_metrics_line(const nlohmann::json& j, RunRecord& r) {
  if (j.value("eval", false)) {
    EvalPoint e;
    e.step = j.value("step", int64_t{0});
    e.samples = j.value("samples", uint64_t{0});
    e.mlm_accuracy = number_or(j, "mlm_accuracy", 0);
    e.nsp_accuracy = number_or(j, "nsp_accuracy", 0);
    e.loss = number_or(j, "eval_loss", NAN);
    r.evals.push_back(e);
  } else {
    RunPoint p;
    p.step = j.value("step", int64_t{0});
    p.samples = j.value("samples", uint64_t{0});
    p.loss = number_or(j, "loss", NAN, &p.finite);
    p.mlm_accuracy = number_or(j, "mlm_accuracy", 0);
    p.seq_per_s = number_or(j, "seq_per_s", 0);
    p.elapsed_s = number_or(j, "elapsed_s", 0);
    p.lr = number_or(j, "lr", NAN);
    p.grad_norm = number_or(j, "grad_norm", NAN);
    r.steps.push_back(p);
  }
}

}  // namespace

RunRecord read_run(const fs::path& run_dir) {
  const fs::path metrics = run_dir / "metrics.jsonl";
  std::ifstream in(metrics);
  NOPAD_CHECK(in.good(), metrics.string(), " cannot be read: give the run_dir of a nopad train run");
  RunRecord r;
  std::string line;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    NOPAD_CHECK(j.is_object(), metrics.string(), " line ", lineno, " is not a JSON object");
    try {
      read_metrics_line(j, r);
    } catch (const nlohmann::json::exception& e) {
      fail(metrics.string(), " line ", lineno, ": a field has the wrong type (", e.what(), "); metrics.jsonl holds "
           "the lines nopad train writes");
    }
  }
  // The MLPerf log, when the run wrote one: the timed run's length and how it ended (the last run of the file).
  std::ifstream ml(run_dir / "mllog.txt");
  int64_t start_ms = -1;
  for (std::string l; std::getline(ml, l);) {
    const std::string prefix = ":::MLLOG ";
    if (l.compare(0, prefix.size(), prefix) != 0) continue;
    const nlohmann::json j = nlohmann::json::parse(l.substr(prefix.size()), nullptr, false);
    if (!j.is_object()) continue;
    try {
      const std::string key = j.value("key", "");
      const int64_t t = j.value("time_ms", int64_t{-1});
      if (key == "run_start") {
        start_ms = t;
        r.run_minutes.reset();
        r.run_status.clear();
      } else if (key == "run_stop" && start_ms >= 0) {
        r.run_minutes = static_cast<double>(t - start_ms) / 60000.0;
        if (j.contains("metadata") && j["metadata"].is_object()) r.run_status = j["metadata"].value("status", "");
      }
    } catch (const nlohmann::json::exception& e) {
      fail((run_dir / "mllog.txt").string(), ": a :::MLLOG line has a field of the wrong type (", e.what(), "): ", l);
    }
  }
  return r;
}

namespace {

// One run's figures, shared by the one-run table and the rows of several.
struct RunFigures {
  double min_loss = INFINITY;
  int non_finite = 0;
  std::optional<double> median_rate;
  const EvalPoint* best = nullptr;  // highest masked-LM accuracy
};

RunFigures figures(const RunRecord& run) {
  RunFigures f;
  std::vector<double> rates;
  for (const RunPoint& p : run.steps) {
    if (p.finite) f.min_loss = std::min(f.min_loss, p.loss);
    else ++f.non_finite;
    if (p.seq_per_s > 0) rates.push_back(p.seq_per_s);
  }
  std::sort(rates.begin(), rates.end());
  if (!rates.empty()) f.median_rate = rates[rates.size() / 2];
  if (!run.evals.empty())
    f.best = &*std::max_element(run.evals.begin(), run.evals.end(),
                                [](const EvalPoint& a, const EvalPoint& b) { return a.mlm_accuracy < b.mlm_accuracy; });
  return f;
}

std::string md_cell(const std::string& s) {  // a table cell: '|' would end it
  std::string out;
  for (const char c : s) out += c == '|' ? std::string("\\|") : std::string(1, c);
  return out;
}

const char* const kPlotsLine =
    "\nPlots: loss.svg (training loss vs samples), accuracy.svg (masked-LM accuracy vs samples), eval_loss.svg (eval "
    "loss vs samples), throughput.svg (sequences/s vs step), learning_rate.svg (learning rate vs step), grad_norm.svg "
    "(gradient norm before clipping vs step).\n";

// The folder a run_dir names, absolute, without a trailing separator ("a/run/", "a/run/." and "a/run" are one).
fs::path normal_dir(const fs::path& dir) {
  fs::path p = fs::absolute(dir).lexically_normal();
  return p.filename().empty() && p.has_parent_path() && p != p.root_path() ? p.parent_path() : p;
}
std::string folder_name(const fs::path& dir) {
  const fs::path p = normal_dir(dir);
  return p.filename().empty() ? p.string() : p.filename().string();  // the root is its own name
}

}  // namespace

std::vector<std::string> run_labels(const std::vector<fs::path>& run_dirs) {
  std::vector<std::string> labels;
  for (const fs::path& d : run_dirs) labels.push_back(folder_name(d));
  std::map<std::string, int> count;
  for (const std::string& l : labels) ++count[l];
  for (size_t i = 0; i < labels.size(); ++i) {
    if (count[labels[i]] < 2) continue;
    const fs::path parent = normal_dir(run_dirs[i]).parent_path();
    if (!parent.filename().empty()) labels[i] = parent.filename().string() + "/" + labels[i];
  }
  count.clear();
  for (const std::string& l : labels) ++count[l];
  std::map<std::string, int> seen;
  for (std::string& l : labels)
    if (count[l] > 1) l += " (" + std::to_string(++seen[l]) + ")";
  return labels;
}

std::string report_markdown(const RunRecord& run, const fs::path& run_dir) {
  std::ostringstream o;
  o << "# nopad run report: " << run_dir.string() << "\n\n";
  if (run.steps.empty() && run.evals.empty()) {
    o << "Nothing logged yet (metrics.jsonl has no training step or evaluation).\n";
    return o.str();
  }
  const RunFigures f = figures(run);
  o << "| | |\n|---|---|\n";
  if (!run.steps.empty()) {
    const RunPoint& last = run.steps.back();
    o << "| steps logged | " << run.steps.size() << " (last step " << last.step << ") |\n";
    o << "| samples | " << last.samples << " |\n";
    o << "| training time | " << fmt(last.elapsed_s / 60.0) << " min |\n";
    o << "| loss: first / last / lowest | " << fmt(run.steps.front().loss) << " / "
      << (last.finite ? fmt(last.loss) : std::string("not finite")) << " / " << fmt(f.min_loss) << " |\n";
    if (f.non_finite > 0) o << "| logged steps with a non-finite loss | " << f.non_finite << " |\n";
    if (f.median_rate) o << "| throughput (median of logged steps) | " << fmt(*f.median_rate) << " seq/s |\n";
  }
  if (!run.evals.empty()) {
    o << "| evaluations | " << run.evals.size() << " |\n";
    o << "| last eval: masked-LM accuracy, NSP accuracy, loss | " << fmt(run.evals.back().mlm_accuracy) << ", "
      << fmt(run.evals.back().nsp_accuracy) << ", " << fmt(run.evals.back().loss) << " (at " << run.evals.back().samples
      << " samples) |\n";
    o << "| best masked-LM accuracy | " << fmt(f.best->mlm_accuracy) << " (at " << f.best->samples << " samples) |\n";
  }
  if (run.run_minutes)
    o << "| MLPerf run (mllog run_start -> run_stop) | " << fmt(*run.run_minutes) << " min, status "
      << (run.run_status.empty() ? "?" : run.run_status) << " |\n";
  o << kPlotsLine;
  return o.str();
}

std::string report_markdown(const std::vector<RunRecord>& runs, const std::vector<fs::path>& run_dirs) {
  NOPAD_CHECK(runs.size() == run_dirs.size() && !runs.empty(), "report_markdown: ", runs.size(), " runs for ",
              run_dirs.size(), " folders");
  if (runs.size() == 1) return report_markdown(runs[0], run_dirs[0]);
  const std::vector<std::string> labels = run_labels(run_dirs);
  std::ostringstream o;
  o << "# nopad run report: " << runs.size() << " runs\n\n";
  o << "| run | folder | steps logged (last step) | samples | training time (min) | loss: first / last / lowest "
       "| throughput (median, seq/s) | evaluations | last eval: masked-LM accuracy, NSP accuracy, loss "
       "| best masked-LM accuracy (samples) | MLPerf run (min, status) |\n";
  o << "|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunRecord& run = runs[i];
    const RunFigures f = figures(run);
    o << "| " << md_cell(labels[i]) << " | " << md_cell(run_dirs[i].string()) << " | ";
    if (run.steps.empty()) {
      o << "none | | | | |";
    } else {
      const RunPoint& last = run.steps.back();
      o << run.steps.size() << " (" << last.step << ") | " << last.samples << " | " << fmt(last.elapsed_s / 60.0)
        << " | " << fmt(run.steps.front().loss) << " / " << (last.finite ? fmt(last.loss) : std::string("not finite"))
        << " / " << fmt(f.min_loss);
      if (f.non_finite > 0) o << " (" << f.non_finite << " not finite)";
      o << " | " << (f.median_rate ? fmt(*f.median_rate) : std::string("")) << " |";
    }
    if (run.evals.empty()) {
      o << " 0 | | |";
    } else {
      const EvalPoint& e = run.evals.back();
      o << ' ' << run.evals.size() << " | " << fmt(e.mlm_accuracy) << ", " << fmt(e.nsp_accuracy) << ", "
        << fmt(e.loss) << " (at " << e.samples << " samples) | " << fmt(f.best->mlm_accuracy) << " (" << f.best->samples
        << ") |";
    }
    if (run.run_minutes)
      o << ' ' << fmt(*run.run_minutes) << ", " << (run.run_status.empty() ? "?" : run.run_status) << " |\n";
    else
      o << " |\n";
  }
  o << kPlotsLine;
  return o.str();
}

double svg_text_width(const std::string& text, double font_px) {
  // Advance widths in em, each at least that of the widest common sans-serif face (DejaVu Sans, the widest of
  // them, then Liberation Sans / Arial / Helvetica), by classes of characters.
  const auto in = [](std::string_view set, char c) { return set.find(c) != std::string_view::npos; };
  double em = 0;
  for (const char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c >= 0x80) {
      if ((c & 0xC0) != 0x80) em += 1.0;  // the first byte of a code point outside ASCII: up to a full em (CJK)
      continue;
    }
    if (ch == ' ') em += 0.33;
    else if (in("ijlI.,:;'|", ch)) em += 0.32;
    else if (in("frt()[]{}-/\\!", ch)) em += 0.42;
    else if (in("mwMW%@", ch)) em += 1.02;
    else if (in("+=<>~#^&", ch)) em += 0.86;
    else if (ch >= 'A' && ch <= 'Z') em += 0.80;
    else em += 0.66;  // the other lower-case letters, digits and signs
  }
  return em * font_px;
}

std::string svg_line_plot(const std::string& title, const std::string& x_label, const std::string& y_label,
                          const std::vector<PlotSeries>& series) {
  constexpr double kFont = 12, kTitleFont = 15, kMinW = 720, T = 40, kPlotH = 320;
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const PlotSeries& s : series)
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  if (!std::isfinite(x0)) x0 = 0, x1 = 1, y0 = 0, y1 = 1;
  if (x1 <= x0) x1 = x0 + 1;
  if (y1 <= y0) y0 -= 0.5, y1 += 0.5;
  const double xs = tick_step(x1 - x0, 6), ys = tick_step(y1 - y0, 5);
  x0 = std::floor(x0 / xs) * xs, x1 = std::ceil(x1 / xs) * xs;
  y0 = std::floor(y0 / ys) * ys, y1 = std::ceil(y1 / ys) * ys;
  std::vector<double> x_ticks, y_ticks;
  for (double x = x0; x <= x1 + xs / 2; x += xs) x_ticks.push_back(x);
  for (double y = y0; y <= y1 + ys / 2; y += ys) y_ticks.push_back(y);

  // Margins from the texts they hold: the rotated y label (x 8..24), the y tick labels right-aligned 6 px left of
  // the axis, half of an x tick label right of the last tick.
  double y_tick_w = 0, x_tick_half = 0;
  for (const double y : y_ticks) y_tick_w = std::max(y_tick_w, svg_text_width(fmt(y), kFont));
  for (const double x : x_ticks) x_tick_half = std::max(x_tick_half, svg_text_width(fmt(x), kFont) / 2);
  const double L = std::max(80.0, 32 + y_tick_w), R = std::max(20.0, x_tick_half + 6);

  // The legend: entries (a 20 px swatch, 6 px, the name) packed into rows under the axes, as wide as the plot; the
  // canvas widens for an entry (or the title) wider than that.
  struct Entry {
    std::string text;
    double width;
  };
  std::vector<Entry> entries;
  double W = kMinW;
  for (const PlotSeries& s : series) {
    const bool empty = std::none_of(s.points.begin(), s.points.end(), [](const std::pair<double, double>& p) {
      return std::isfinite(p.first) && std::isfinite(p.second);
    });
    Entry e{s.name + (empty ? " (no data)" : ""), 0};
    e.width = 26 + svg_text_width(e.text, kFont);
    W = std::max(W, L + e.width + R);
    entries.push_back(std::move(e));
  }
  W = std::max(W, svg_text_width(title, kTitleFont) + 16);
  W = std::ceil(W);
  constexpr double kGap = 18, kRow = 18;
  std::vector<std::pair<double, double>> entry_xy;  // text baseline start of each entry's swatch
  const double legend_top = T + kPlotH + 44 + 24;   // first row's baseline: under the x axis label
  double lx = L, row = 0;
  for (const Entry& e : entries) {
    if (lx > L && lx + e.width > W - R) lx = L, ++row;
    entry_xy.emplace_back(lx, legend_top + row * kRow);
    lx += e.width + kGap;
  }
  const double H = entries.empty() ? T + kPlotH + 60 : legend_top + row * kRow + 12;

  const auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  const auto py = [&](double y) { return T + kPlotH - (y - y0) / (y1 - y0) * kPlotH; };
  static const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e",
                                  "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
    << ' ' << H << "\" font-family=\"sans-serif\" font-size=\"" << kFont << "\">\n";
  o << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"" << kTitleFont << "\">"
    << xml_escape(title) << "</text>\n";
  for (const double x : x_ticks) {
    o << "<line x1=\"" << px(x) << "\" y1=\"" << T << "\" x2=\"" << px(x) << "\" y2=\"" << T + kPlotH
      << "\" stroke=\"#eee\"/>\n";
    o << "<text x=\"" << px(x) << "\" y=\"" << T + kPlotH + 16 << "\" text-anchor=\"middle\">" << fmt(x) << "</text>\n";
  }
  for (const double y : y_ticks) {
    o << "<line x1=\"" << L << "\" y1=\"" << py(y) << "\" x2=\"" << W - R << "\" y2=\"" << py(y)
      << "\" stroke=\"#eee\"/>\n";
    o << "<text x=\"" << L - 6 << "\" y=\"" << py(y) + 4 << "\" text-anchor=\"end\">" << fmt(y) << "</text>\n";
  }
  o << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << W - L - R << "\" height=\"" << kPlotH
    << "\" fill=\"none\" stroke=\"black\"/>\n";
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << T + kPlotH + 44 << "\" text-anchor=\"middle\">"
    << xml_escape(x_label) << "</text>\n";
  o << "<text transform=\"translate(18," << T + kPlotH / 2 << ") rotate(-90)\" text-anchor=\"middle\">"
    << xml_escape(y_label) << "</text>\n";
  for (size_t i = 0; i < series.size(); ++i) {
    const char* color = kColors[i % 10];
    o << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.5\" points=\"";
    for (const auto& [x, y] : series[i].points)
      if (std::isfinite(x) && std::isfinite(y)) o << px(x) << ',' << py(y) << ' ';
    o << "\"/>\n";
    if (series[i].points.size() <= 40)  // few points (evaluations): mark them
      for (const auto& [x, y] : series[i].points)
        if (std::isfinite(x) && std::isfinite(y))
          o << "<circle cx=\"" << px(x) << "\" cy=\"" << py(y) << "\" r=\"3\" fill=\"" << color << "\"/>\n";
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto [ex, ey] = entry_xy[i];
    o << "<line x1=\"" << ex << "\" y1=\"" << ey - 4 << "\" x2=\"" << ex + 20 << "\" y2=\"" << ey - 4
      << "\" stroke=\"" << kColors[i % 10] << "\" stroke-width=\"2\"/>\n";
    o << "<text class=\"legend\" x=\"" << ex + 26 << "\" y=\"" << ey << "\">" << xml_escape(entries[i].text)
      << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

const std::vector<std::string>& report_plot_files() {
  static const std::vector<std::string> files = {"loss.svg",       "accuracy.svg",      "eval_loss.svg",
                                                 "throughput.svg", "learning_rate.svg", "grad_norm.svg"};
  return files;
}

std::string write_report(const fs::path& run_dir, const fs::path& out_dir) {
  return write_report(std::vector<fs::path>{run_dir}, out_dir);
}

std::string write_report(const std::vector<fs::path>& run_dirs, const fs::path& out_dir) {
  NOPAD_CHECK(!run_dirs.empty(), "nopad report needs at least one run_dir");
  std::vector<RunRecord> runs;
  for (const fs::path& d : run_dirs) runs.push_back(read_run(d));
  const bool one = runs.size() == 1;
  const std::vector<std::string> labels = run_labels(run_dirs);
  // One series per run (one run: named for what it shows), each a function of one run's record.
  const auto per_run = [&](const std::string& one_name, auto&& points_of) {
    std::vector<PlotSeries> out;
    for (size_t i = 0; i < runs.size(); ++i) out.push_back({one ? one_name : labels[i], points_of(runs[i])});
    return out;
  };
  using Points = std::vector<std::pair<double, double>>;
  const auto loss = per_run("training loss", [](const RunRecord& r) {
    Points p;
    for (const RunPoint& s : r.steps)
      if (s.finite) p.emplace_back(static_cast<double>(s.samples), s.loss);
    return p;
  });
  std::vector<PlotSeries> accuracy = per_run("masked-LM accuracy (eval)", [](const RunRecord& r) {
    Points p;
    for (const EvalPoint& e : r.evals) p.emplace_back(static_cast<double>(e.samples), e.mlm_accuracy);
    return p;
  });
  if (one) {  // one run: the training batches' accuracy too, first, as it always is there
    PlotSeries train{"masked-LM accuracy (training batches)", {}};
    for (const RunPoint& s : runs[0].steps) train.points.emplace_back(static_cast<double>(s.samples), s.mlm_accuracy);
    if (accuracy[0].points.empty()) accuracy.clear();
    accuracy.insert(accuracy.begin(), std::move(train));
  }
  const auto eval_loss = per_run("eval loss", [](const RunRecord& r) {
    Points p;
    for (const EvalPoint& e : r.evals) p.emplace_back(static_cast<double>(e.samples), e.loss);
    return p;
  });
  const auto by_step = [&](const std::string& one_name, double RunPoint::*field, bool positive) {
    return per_run(one_name, [=](const RunRecord& r) {
      Points p;
      for (const RunPoint& s : r.steps)
        if (std::isfinite(s.*field) && (!positive || s.*field > 0))
          p.emplace_back(static_cast<double>(s.step), s.*field);
      return p;
    });
  };
  const std::string md = report_markdown(runs, run_dirs);
  ensure_writable_dir(out_dir);
  write_file_atomic(out_dir / "report.md", md);
  write_file_atomic(out_dir / "loss.svg", svg_line_plot("Training loss", "samples", "loss", loss));
  write_file_atomic(out_dir / "accuracy.svg", svg_line_plot(one ? "Masked-LM accuracy" : "Masked-LM accuracy (eval)",
                                                            "samples", "accuracy", accuracy));
  write_file_atomic(out_dir / "eval_loss.svg",
                    svg_line_plot("Eval loss (masked LM + next sentence)", "samples", "loss", eval_loss));
  write_file_atomic(out_dir / "throughput.svg", svg_line_plot("Throughput", "step", "sequences/s",
                                                              by_step("sequences/s", &RunPoint::seq_per_s, true)));
  write_file_atomic(out_dir / "learning_rate.svg", svg_line_plot("Learning rate", "step", "learning rate",
                                                                 by_step("learning rate", &RunPoint::lr, false)));
  write_file_atomic(out_dir / "grad_norm.svg",
                    svg_line_plot("Gradient norm (before clipping)", "step", "gradient norm",
                                  by_step("gradient norm", &RunPoint::grad_norm, false)));
  return md;
}

}  // namespace nopad
