// nopad eval: masked-LM / NSP evaluation of a checkpoint folder (nopad's, or a Hugging Face one with
// model.safetensors + config.json) on a shard folder, in order, dropout off, on the CPU or a GPU. Prints one JSON
// line on stdout (progress goes to stderr); `loss` is mean MLM cross-entropy + mean NSP cross-entropy, what Hugging
// Face BertForPreTraining returns for the same samples evaluated as one batch (labels -100 outside the masked
// positions).
#include <algorithm>
#include <climits>
#include <cstdio>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "core/error.h"
#include "core/host_memory.h"
#include "core/progress.h"
#include "dist/launch.h"
#include "model/bert.h"
#include "train/checkpoint.h"
#include "train/engine.h"
#include "train/trainer.h"

namespace {

struct EvalArgs {
  std::string checkpoint, data, device = "cpu";
  uint64_t max_samples = 0;
  int32_t batch = 32;
  int threads = 0;
  bool quiet = false;
};

void run(const EvalArgs& a) {
  NOPAD_CHECK(a.batch > 0, "--batch must be positive, got ", a.batch);
  nopad::BertConfig config;
  const std::vector<float> params = nopad::load_model_folder(a.checkpoint, "--checkpoint", &config);
  const nopad::Dataset data(a.data);
  NOPAD_CHECK(static_cast<uint64_t>(config.vocab_size) >= data.vocab_size(), "checkpoint vocab_size ",
              config.vocab_size, " is smaller than the vocabulary of ", a.data, " (", data.vocab_size(), ")");
  NOPAD_CHECK(static_cast<uint32_t>(config.max_position_embeddings) >= data.max_seq_length(),
              "checkpoint max_position_embeddings ", config.max_position_embeddings,
              " is smaller than the longest sequence of ", a.data, " (", data.max_seq_length(), ")");
  std::string note;
  const std::string device = nopad::resolve_device(a.device, &note);
  const uint64_t n = a.max_samples > 0 ? std::min<uint64_t>(a.max_samples, data.size()) : data.size();
  // A forward pass never holds more sequences than are evaluated; its buffers are sized for that many.
  const int32_t batch = static_cast<int32_t>(std::min<uint64_t>(static_cast<uint64_t>(a.batch), std::max<uint64_t>(n, 1)));
  const int64_t max_len = data.max_seq_length(), max_masked = nopad::max_masked_per_sample(data);
  NOPAD_CHECK(batch * max_len <= INT32_MAX, "--batch ", a.batch, " of sequences of up to ", max_len, " tokens is ",
              batch * max_len, " tokens, more than a forward pass can hold (", INT32_MAX, "): use --batch ",
              INT32_MAX / std::max<int64_t>(max_len, 1), " or less");
  nopad::EngineOptions eo;
  eo.config = config;
  eo.precision = nopad::resolve_precision("auto", device);
  eo.threads = a.threads > 0 ? a.threads : nopad::dist::default_cpu_threads();
  if (device == "cpu")
    nopad::check_cpu_batch_fits(eo, a.batch, batch, max_len, max_masked, nopad::host_memory_available());
  std::unique_ptr<nopad::TrainEngine> engine;
  try {
    engine = nopad::make_engine(device, nopad::with_batch(eo, batch, max_len, max_masked));
  } catch (const nopad::OutOfMemory& e) {
    if (device == "cpu") throw;
    // The GPU's message ends with advice for training; eval's knob is --batch.
    std::string what = e.what();
    if (const size_t at = what.find(". Lower train.global_batch"); at != std::string::npos) what.resize(at);
    const uint64_t per_seq = nopad::BertModel<nopad::ops::GpuBf16>::planned_bytes(config, 2 * max_len, 2, 2 * max_masked,
                                                                                    config.vocab_size) -
                             nopad::BertModel<nopad::ops::GpuBf16>::planned_bytes(config, max_len, 1, max_masked,
                                                                                    config.vocab_size);
    throw nopad::OutOfMemory(nopad::str_cat("--batch ", batch, " does not fit on the GPU: ", what, ". Each sequence of "
                                            "up to ", max_len, " tokens takes about ", nopad::format_bytes(per_seq),
                                            " of activations there: use a smaller --batch"));
  }
  engine->set_params(params.data());
  if (!a.quiet)
    std::fprintf(stderr, "eval: %s on %llu samples of %s, %s %s\n", a.checkpoint.c_str(),
                 static_cast<unsigned long long>(n), a.data.c_str(), engine->device_name().c_str(),
                 engine->precision().c_str());
  nopad::Progress progress("eval", static_cast<double>(n), "seqs", !a.quiet, 5.0);
  const nopad::EvalResult r = nopad::evaluate(*engine, data, a.max_samples, batch, &progress);
  progress.finish();
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
  sub.add_option("--device", a->device, "cpu (fp32, the reference arithmetic), cuda (bf16, as training on a GPU "
                 "evaluates) or auto (the GPU when one is visible)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  sub.add_option("--threads", a->threads, "CPU threads (0 = the cores, divided among the ranks of an MPI job)")
      ->capture_default_str();
  sub.add_flag("--quiet", a->quiet, "no progress on stderr");
  sub.callback([a] { run(*a); });
}

NOPAD_REGISTER_COMMAND("eval", "masked-LM / NSP accuracy and loss of a checkpoint on shards", 60, setup);

}  // namespace
