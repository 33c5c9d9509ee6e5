// nopad report RUN_DIR [RUN_DIR ...]: runs at a glance (train/report.h): a Markdown summary on stdout and in
// OUT/report.md, and SVG plots of the loss, the accuracy, the eval loss, the throughput, the learning rate and the
// gradient norm, several runs overlaid.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "core/error.h"
#include "train/report.h"

namespace {

void setup(CLI::App& sub) {
  auto run_dirs = std::make_shared<std::vector<std::string>>();
  auto out = std::make_shared<std::string>();
  sub.add_option("run_dir", *run_dirs,
                 "the run_dir of a nopad train run (reads metrics.jsonl, and mllog.txt if there); several are "
                 "overlaid in each plot, one line per run named by its folder, and get a table row each")
      ->required();
  sub.add_option("--output", *out, "folder for report.md, loss.svg, accuracy.svg, eval_loss.svg, throughput.svg, "
                                   "learning_rate.svg, grad_norm.svg (default RUN_DIR/report with one run; required "
                                   "with several)");
  sub.callback([=] {
    NOPAD_CHECK(run_dirs->size() == 1 || !out->empty(), "nopad report of ", run_dirs->size(), " runs needs --output "
                "FOLDER: the folder for the report and the plots of them together");
    const std::vector<nopad::fs::path> dirs(run_dirs->begin(), run_dirs->end());
    const nopad::fs::path target = out->empty() ? dirs[0] / "report" : nopad::fs::path(*out);
    const std::string md = nopad::write_report(dirs, target);
    std::fputs(md.c_str(), stdout);
    std::string files = "report.md";
    for (const std::string& f : nopad::report_plot_files()) files += ", " + f;
    std::printf("\nwrote %s/{%s}\n", target.string().c_str(), files.c_str());
  });
}

NOPAD_REGISTER_COMMAND("report", "summarise training runs: a table and SVG plots of loss, accuracy, throughput, "
                       "learning rate, gradient norm (several runs overlaid)", 55, setup);

}  // namespace
