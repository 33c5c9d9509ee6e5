// nopad train: pre-trains BERT from a TOML config (train/trainer.h); `--help` lists every config key with its
// default, generated from the schema so it cannot drift from what the trainer accepts.
#include <cstdio>
#include <memory>

#include "cli/command.h"
#include "core/error.h"
#include "train/trainer.h"

namespace {

std::string keys_help() {
  const nopad::ConfigSchema schema = nopad::train_config_schema();
  std::string s = "Config keys (TOML: `[section]` then `key = value`; override with --set section.key=value):\n";
  for (const auto& k : schema.keys()) {
    std::string def = k.default_value.text;
    if (k.type == nopad::ConfigType::kString) def = "\"" + def + "\"";
    s += "  " + k.key + " = " + def + "\n      " + k.help + "\n";
  }
  return s;
}

void setup(CLI::App& sub) {
  auto config_path = std::make_shared<std::string>();
  auto overrides = std::make_shared<std::vector<std::string>>();
  auto resume = std::make_shared<bool>(false);
  auto overwrite = std::make_shared<bool>(false);
  sub.add_option("--config", *config_path, "training config (TOML); see the keys below")->required();
  sub.add_option("--set", *overrides, "override a config key: --set optim.lr=2e-3 (repeatable)");
  sub.add_flag("--resume", *resume, "continue the run in run_dir from checkpoints/latest");
  sub.add_flag("--overwrite", *overwrite, "start over, deleting run_dir's checkpoints and metrics");
  auto mllog_stdout = std::make_shared<bool>(false);
  sub.add_flag("--mllog-stdout", *mllog_stdout,
               "also print the MLPerf log (run_dir/mllog.txt, ':::MLLOG' lines) on standard output");
  auto device = std::make_shared<std::string>();
  sub.add_option("--device", *device,
                 "auto, cpu or cuda: where to train (same as --set train.device=...; auto takes the GPU when one is "
                 "visible, else the CPU, and says so)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  sub.footer(keys_help());
  sub.callback([=] {
    if (*resume && *overwrite) nopad::fail("--resume and --overwrite exclude each other");
    nopad::Config config = nopad::Config::load(*config_path, nopad::train_config_schema());
    for (const auto& o : *overrides) config.apply_override(o);
    if (!device->empty()) config.apply_override("train.device=" + *device);
    if (*mllog_stdout) config.apply_override("mllog.stdout=true");
    const nopad::StartMode mode = *resume ? nopad::StartMode::kResume
                                  : *overwrite ? nopad::StartMode::kOverwrite
                                               : nopad::StartMode::kFresh;
    nopad::Trainer trainer(config, mode);
    const nopad::TrainSummary s = trainer.run();
    if (s.rank != 0) return;  // data parallel: rank 0 reports
    if (!s.evals.empty()) {
      const auto& e = s.evals.back();
      std::printf("final: step %lld, samples %llu, eval mlm_accuracy %.4f (frequency baseline %.4f), nsp_accuracy "
                  "%.4f, loss %.4f%s\n", static_cast<long long>(s.final_step),
                  static_cast<unsigned long long>(s.samples), e.mlm_accuracy, s.mlm_baseline, e.nsp_accuracy, e.loss,
                  s.reached_target ? " (target reached)" : "");
    } else {
      std::printf("final: step %lld, samples %llu\n", static_cast<long long>(s.final_step),
                  static_cast<unsigned long long>(s.samples));
    }
  });
}

NOPAD_REGISTER_COMMAND("train", "pre-train BERT from a config file (resumable)", 50, setup);

}  // namespace
