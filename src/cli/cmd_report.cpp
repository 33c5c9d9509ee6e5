// nopad report RUN_DIR: a run at a glance (train/report.h): a Markdown summary on stdout and in OUT/report.md, and
// SVG plots of the loss, the masked-LM accuracy and the throughput.
#include <cstdio>
#include <memory>
#include <string>

#include "cli/command.h"
#include "train/report.h"

namespace {

void setup(CLI::App& sub) {
  auto run_dir = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  sub.add_option("run_dir", *run_dir, "the run_dir of a nopad train run (reads metrics.jsonl, and mllog.txt if there)")
      ->required();
  sub.add_option("--output", *out, "folder for report.md, loss.svg, accuracy.svg, throughput.svg (default "
                                   "RUN_DIR/report)");
  sub.callback([=] {
    const nopad::fs::path dir = *run_dir;
    const nopad::fs::path target = out->empty() ? dir / "report" : nopad::fs::path(*out);
    const std::string md = nopad::write_report(dir, target);
    std::fputs(md.c_str(), stdout);
    std::printf("\nwrote %s/{report.md, loss.svg, accuracy.svg, throughput.svg}\n", target.string().c_str());
  });
}

NOPAD_REGISTER_COMMAND("report", "summarise a training run: a table and SVG plots of loss, accuracy, throughput", 55,
                       setup);

}  // namespace
