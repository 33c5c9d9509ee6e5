// nopad fill-mask --checkpoint DIR "text with [MASK]" ...: the most probable tokens for each [MASK] (train/fill_mask.h).
// Texts come from the command line, or one per line from standard input when none is given. Plain output: per text,
// the text with the best tokens filled in, then one line per [MASK] with the top-k tokens and probabilities;
// --json: one JSON object per text (as Hugging Face's fill-mask pipeline: token, token_str, score).
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "train/fill_mask.h"

namespace {

void setup(CLI::App& sub) {
  auto opt = std::make_shared<nopad::FillMaskOptions>();
  auto texts = std::make_shared<std::vector<std::string>>();
  auto json = std::make_shared<bool>(false);
  auto checkpoint = std::make_shared<std::string>();
  sub.add_option("--checkpoint", *checkpoint,
                 "model folder: a training checkpoint (RUN_DIR/checkpoints/step_...), nopad convert's output, or a "
                 "Hugging Face BertForPreTraining folder")
      ->required();
  sub.add_option("texts", *texts, "texts with [MASK] where a token is to be predicted (none: one per line on stdin)");
  sub.add_option("--top-k", opt->top_k, "candidates per [MASK]")->capture_default_str();
  sub.add_option("--device", opt->device, "auto, cpu or cuda (auto: the GPU when one is visible)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  sub.add_option("--vocab", opt->vocab, "vocabulary, for a folder without tokenizer files (an older checkpoint)");
  sub.add_option("--do-lower-case", opt->lower_case, "with --vocab: auto (follow the vocabulary), true or false")
      ->check(CLI::IsMember({"auto", "true", "false"}))
      ->capture_default_str();
  sub.add_option("--threads", opt->threads, "CPU threads (0 = the cores)")->capture_default_str();
  sub.add_flag("--json", *json, "one JSON object per text instead of the plain listing");
  sub.callback([=] {
    opt->model_dir = *checkpoint;
    std::vector<std::string> input = *texts;
    if (input.empty()) {
      std::string line;
      while (std::getline(std::cin, line))
        if (!line.empty()) input.push_back(line);
    }
    std::string device;
    const std::vector<nopad::FillMaskAnswer> answers = nopad::fill_mask(*opt, input, &device);
    if (!*json) std::fprintf(stderr, "fill-mask: %s on %s\n", checkpoint->c_str(), device.c_str());
    for (const nopad::FillMaskAnswer& a : answers) {
      if (*json) {
        nlohmann::json masks = nlohmann::json::array();
        for (const auto& list : a.masks) {
          nlohmann::json cands = nlohmann::json::array();
          for (const auto& c : list) cands.push_back({{"token", c.id}, {"token_str", c.token}, {"score", c.probability}});
          masks.push_back(cands);
        }
        std::printf("%s\n", nlohmann::json{{"text", a.text}, {"filled", a.filled}, {"masks", masks}}.dump().c_str());
        continue;
      }
      std::printf("%s\n", a.filled.c_str());
      for (size_t k = 0; k < a.masks.size(); ++k) {
        std::printf("  [MASK]%s:", a.masks.size() > 1 ? (" " + std::to_string(k + 1)).c_str() : "");
        for (const auto& c : a.masks[k]) std::printf("  %s %.3f", c.token.c_str(), c.probability);
        std::printf("\n");
      }
    }
  });
}

NOPAD_REGISTER_COMMAND("fill-mask", "predict the [MASK] tokens of texts with a trained checkpoint", 65, setup);

}  // namespace
