// nopad eval: masked-LM / NSP evaluation of a checkpoint folder (nopad's, or a Hugging Face one with
// model.safetensors + config.json) on a shard folder, in order, dropout off. Prints one JSON line; `loss` is
// mean MLM cross-entropy + mean NSP cross-entropy, what Hugging Face BertForPreTraining returns for the same samples
// evaluated as one batch (labels -100 outside the masked positions).
#include <cmath>
#include <cstdio>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "core/error.h"
#include "model/params.h"
#include "ops/cpu/cpu_backend.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace {

struct EvalArgs {
  std::string checkpoint, data;
  uint64_t max_samples = 0;
  int32_t batch = 32;
  int threads = 0;
};

void run(const EvalArgs& a) {
  namespace fs = std::filesystem;
  std::error_code ec;
  NOPAD_CHECK(fs::is_directory(a.checkpoint, ec), "--checkpoint ", a.checkpoint,
              " is not a folder (expected a checkpoint folder with model.safetensors and config.json)");
  NOPAD_CHECK(a.batch > 0, "--batch must be positive, got ", a.batch);
  const fs::path dir = a.checkpoint;
  NOPAD_CHECK(!fs::exists(dir / "checkpoints" / "latest", ec), "--checkpoint ", a.checkpoint, " is a run folder: give "
              "one of its checkpoints, e.g. ", (dir / "checkpoints").string(), "/$(cat ",
              (dir / "checkpoints" / "latest").string(), ")");
  const nopad::BertConfig config = nopad::read_hf_config(dir / "config.json");
  const nopad::ParamLayout layout(config);
  std::vector<float> params(layout.total_numel());
  if (fs::exists(dir / "trainer_state.json", ec)) {
    params = nopad::load_checkpoint(dir, &config, /*with_optimizer=*/false).params;  // verified nopad checkpoint
  } else {
    nopad::load_hf_weights(dir, layout, params.data());
  }
  // Weights that are not finite (a diverged run's last checkpoint) would only give a null loss.
  for (const nopad::ParamTensor& t : layout.tensors())
    for (size_t i = 0; i < t.numel; ++i)
      NOPAD_CHECK(std::isfinite(params[t.offset + i]), "checkpoint ", a.checkpoint, ": tensor ", t.name,
                  " holds a non-finite value (element ", i, "): the run that wrote it diverged; evaluate an earlier "
                  "checkpoint");
  const nopad::Dataset data(a.data);
  NOPAD_CHECK(static_cast<uint64_t>(config.vocab_size) >= data.vocab_size(), "checkpoint vocab_size ",
              config.vocab_size, " is smaller than the vocabulary of ", a.data, " (", data.vocab_size(), ")");
  NOPAD_CHECK(static_cast<uint32_t>(config.max_position_embeddings) >= data.max_seq_length(),
              "checkpoint max_position_embeddings ", config.max_position_embeddings,
              " is smaller than the longest sequence of ", a.data, " (", data.max_seq_length(), ")");
  const uint32_t max_masked = nopad::max_masked_per_sample(data);
  nopad::ops::CpuBackend<nopad::ops::CpuF32> backend(a.threads);
  nopad::BertModel<nopad::ops::CpuF32> model(config, backend,
                                             a.batch * static_cast<int32_t>(data.max_seq_length()), a.batch,
                                             a.batch * static_cast<int32_t>(max_masked));
  model.set_params(params.data());
  const nopad::EvalResult r = nopad::evaluate(model, data, a.max_samples, a.batch);
  const nlohmann::json j = {{"mlm_accuracy", r.mlm_accuracy}, {"nsp_accuracy", r.nsp_accuracy},
                            {"mlm_loss", r.mlm_loss},         {"nsp_loss", r.nsp_loss},
                            {"loss", r.loss},                 {"samples", r.samples},
                            {"masked", r.masked}};
  std::printf("%s\n", j.dump().c_str());
}

void setup(CLI::App& sub) {
  auto a = std::make_shared<EvalArgs>();
  sub.add_option("--checkpoint", a->checkpoint, "checkpoint folder (nopad's step_XXXXXXXX, or Hugging Face's)")
      ->required();
  sub.add_option("--data", a->data, "folder of .nopad shards")->required();
  sub.add_option("--max-samples", a->max_samples, "evaluate the first N samples (0 = all)")->capture_default_str();
  sub.add_option("--batch", a->batch, "sequences per forward pass")->capture_default_str();
  sub.add_option("--threads", a->threads, "CPU threads (0 = all cores)")->capture_default_str();
  sub.callback([a] { run(*a); });
}

NOPAD_REGISTER_COMMAND("eval", "masked-LM / NSP accuracy and loss of a checkpoint on shards", 60, setup);

}  // namespace
