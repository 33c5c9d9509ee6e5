// The run report (see report.h).
#include "train/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

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

std::string report_markdown(const RunRecord& run, const fs::path& run_dir) {
  std::ostringstream o;
  o << "# nopad run report: " << run_dir.string() << "\n\n";
  if (run.steps.empty() && run.evals.empty()) {
    o << "Nothing logged yet (metrics.jsonl has no training step or evaluation).\n";
    return o.str();
  }
  o << "| | |\n|---|---|\n";
  if (!run.steps.empty()) {
    const RunPoint& last = run.steps.back();
    double min_loss = INFINITY;
    std::vector<double> rates;
    int non_finite = 0;
    for (const RunPoint& p : run.steps) {
      if (p.finite) min_loss = std::min(min_loss, p.loss);
      else ++non_finite;
      if (p.seq_per_s > 0) rates.push_back(p.seq_per_s);
    }
    std::sort(rates.begin(), rates.end());
    o << "| steps logged | " << run.steps.size() << " (last step " << last.step << ") |\n";
    o << "| samples | " << last.samples << " |\n";
    o << "| training time | " << fmt(last.elapsed_s / 60.0) << " min |\n";
    o << "| loss: first / last / lowest | " << fmt(run.steps.front().loss) << " / "
      << (last.finite ? fmt(last.loss) : std::string("not finite")) << " / " << fmt(min_loss) << " |\n";
    if (non_finite > 0) o << "| logged steps with a non-finite loss | " << non_finite << " |\n";
    if (!rates.empty())
      o << "| throughput (median of logged steps) | " << fmt(rates[rates.size() / 2]) << " seq/s |\n";
  }
  if (!run.evals.empty()) {
    const auto best = std::max_element(run.evals.begin(), run.evals.end(), [](const EvalPoint& a, const EvalPoint& b) {
      return a.mlm_accuracy < b.mlm_accuracy;
    });
    o << "| evaluations | " << run.evals.size() << " |\n";
    o << "| last eval: masked-LM accuracy, NSP accuracy, loss | " << fmt(run.evals.back().mlm_accuracy) << ", "
      << fmt(run.evals.back().nsp_accuracy) << ", " << fmt(run.evals.back().loss) << " (at " << run.evals.back().samples
      << " samples) |\n";
    o << "| best masked-LM accuracy | " << fmt(best->mlm_accuracy) << " (at " << best->samples << " samples) |\n";
  }
  if (run.run_minutes)
    o << "| MLPerf run (mllog run_start -> run_stop) | " << fmt(*run.run_minutes) << " min, status "
      << (run.run_status.empty() ? "?" : run.run_status) << " |\n";
  o << "\nPlots: loss.svg (training loss vs samples), accuracy.svg (masked-LM accuracy vs samples), throughput.svg "
       "(sequences/s vs step).\n";
  return o.str();
}

std::string svg_line_plot(const std::string& title, const std::string& x_label, const std::string& y_label,
                          const std::vector<PlotSeries>& series) {
  constexpr double W = 720, H = 420, L = 80, R = 20, T = 40, B = 60;  // canvas and margins
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
  const auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  const auto py = [&](double y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };

  static const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"};
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
    << ' ' << H << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  o << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">" << xml_escape(title)
    << "</text>\n";
  for (double x = x0; x <= x1 + xs / 2; x += xs) {
    o << "<line x1=\"" << px(x) << "\" y1=\"" << T << "\" x2=\"" << px(x) << "\" y2=\"" << H - B
      << "\" stroke=\"#eee\"/>\n";
    o << "<text x=\"" << px(x) << "\" y=\"" << H - B + 16 << "\" text-anchor=\"middle\">" << fmt(x) << "</text>\n";
  }
  for (double y = y0; y <= y1 + ys / 2; y += ys) {
    o << "<line x1=\"" << L << "\" y1=\"" << py(y) << "\" x2=\"" << W - R << "\" y2=\"" << py(y)
      << "\" stroke=\"#eee\"/>\n";
    o << "<text x=\"" << L - 6 << "\" y=\"" << py(y) + 4 << "\" text-anchor=\"end\">" << fmt(y) << "</text>\n";
  }
  o << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << W - L - R << "\" height=\"" << H - T - B
    << "\" fill=\"none\" stroke=\"black\"/>\n";
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 16 << "\" text-anchor=\"middle\">" << xml_escape(x_label)
    << "</text>\n";
  o << "<text transform=\"translate(18," << (T + H - B) / 2 << ") rotate(-90)\" text-anchor=\"middle\">"
    << xml_escape(y_label) << "</text>\n";
  for (size_t i = 0; i < series.size(); ++i) {
    const char* color = kColors[i % 5];
    o << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.5\" points=\"";
    for (const auto& [x, y] : series[i].points)
      if (std::isfinite(x) && std::isfinite(y)) o << px(x) << ',' << py(y) << ' ';
    o << "\"/>\n";
    if (series[i].points.size() <= 40)  // few points (evaluations): mark them
      for (const auto& [x, y] : series[i].points)
        if (std::isfinite(x) && std::isfinite(y))
          o << "<circle cx=\"" << px(x) << "\" cy=\"" << py(y) << "\" r=\"3\" fill=\"" << color << "\"/>\n";
    const double ly = T + 16 + 16 * static_cast<double>(i);
    o << "<line x1=\"" << W - R - 150 << "\" y1=\"" << ly - 4 << "\" x2=\"" << W - R - 130 << "\" y2=\"" << ly - 4
      << "\" stroke=\"" << color << "\" stroke-width=\"2\"/>\n";
    o << "<text x=\"" << W - R - 125 << "\" y=\"" << ly << "\">" << xml_escape(series[i].name) << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

std::string write_report(const fs::path& run_dir, const fs::path& out_dir) {
  const RunRecord run = read_run(run_dir);
  PlotSeries loss{"training loss", {}}, train_acc{"masked-LM accuracy (training batches)", {}},
      eval_acc{"masked-LM accuracy (eval)", {}}, rate{"sequences/s", {}};
  for (const RunPoint& p : run.steps) {
    if (p.finite) loss.points.emplace_back(static_cast<double>(p.samples), p.loss);
    train_acc.points.emplace_back(static_cast<double>(p.samples), p.mlm_accuracy);
    if (p.seq_per_s > 0) rate.points.emplace_back(static_cast<double>(p.step), p.seq_per_s);
  }
  for (const EvalPoint& e : run.evals) eval_acc.points.emplace_back(static_cast<double>(e.samples), e.mlm_accuracy);
  const std::string md = report_markdown(run, run_dir);
  ensure_writable_dir(out_dir);
  write_file_atomic(out_dir / "report.md", md);
  write_file_atomic(out_dir / "loss.svg", svg_line_plot("Training loss", "samples", "loss", {loss}));
  std::vector<PlotSeries> acc = {train_acc};
  if (!eval_acc.points.empty()) acc.push_back(eval_acc);
  write_file_atomic(out_dir / "accuracy.svg", svg_line_plot("Masked-LM accuracy", "samples", "accuracy", acc));
  write_file_atomic(out_dir / "throughput.svg", svg_line_plot("Throughput", "step", "sequences/s", {rate}));
  return md;
}

}  // namespace nopad
