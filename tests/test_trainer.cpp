// The training loop end to end on small models: the loss falls and eval accuracy rises, a stopped and resumed run is
// bit-identical to an uninterrupted one, bad inputs give one clear error before anything is written, and a
// diverging run stops naming the step while keeping its last good checkpoint.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <sstream>

#include "core/error.h"
#include "data/prepare.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"
#include "train/trainer.h"
#include "ops/cpu/cpu_backend.h"

namespace nopad {
namespace {

namespace fs = std::filesystem;

// Shards made once for the whole suite: wiki_00 (train) and wiki_01 (held-out eval), max_seq_length 128, dupe 1.
struct SharedData {
  test::TempDir dir{"trainer-data"};
  fs::path train, eval;
  SharedData() {
    for (const char* part : {"wiki_00", "wiki_01"}) {
      PrepareOptions o;
      o.inputs = {test::wiki_sample_dir() / part};
      o.vocab = test::vocab_path();
      o.output = dir / part;
      o.instances.max_seq_length = 128;
      o.instances.dupe_factor = 1;
      o.threads = 2;
      o.progress = false;
      prepare_dataset(o);
    }
    train = dir / "wiki_00";
    eval = dir / "wiki_01";
  }
};
const SharedData& data() {
  static SharedData d;
  return d;
}

fs::path write_model_config(const fs::path& dir, int hidden, int layers, int heads, int vocab = 30522,
                            int max_pos = 128) {
  nlohmann::json j = {{"hidden_size", hidden},       {"num_hidden_layers", layers},
                      {"num_attention_heads", heads}, {"intermediate_size", 4 * hidden},
                      {"vocab_size", vocab},          {"max_position_embeddings", max_pos},
                      {"type_vocab_size", 2},         {"model_type", "bert"}};
  const fs::path p = dir / ("model-" + std::to_string(hidden) + "-" + std::to_string(heads) + "-" +
                            std::to_string(vocab) + "-" + std::to_string(max_pos) + ".json");
  std::ofstream(p) << j.dump(2);
  return p;
}

// These tests pin the CPU reference's behaviour (bit-identical resume is a CPU guarantee), so they run on the CPU
// even on a machine with a GPU, where train.device = auto would pick it.
Config make_config(const std::string& text) {
  Config c = Config::parse(text, train_config_schema(), "test");
  c.apply_override("train.device=cpu");
  return c;
}

// A config for a small fast run; extra lines override.
std::string base_config(const fs::path& run_dir, const fs::path& model_config, const std::string& extra = "") {
  std::ostringstream s;
  s << "run_dir = \"" << run_dir.string() << "\"\n"
    << "model.config = \"" << model_config.string() << "\"\n"
    << "data.train = \"" << data().train.string() << "\"\n"
    << "train.threads = 2\n"
    << (extra.find("log.interval_steps") == std::string::npos ? "log.interval_steps = 1000\n" : "") << extra;
  return s.str();
}

using test::error_of;

double mean_mlm_loss(const std::vector<StepRecord>& steps, size_t begin, size_t end) {
  double s = 0;
  for (size_t i = begin; i < end; ++i) s += steps[i].mlm_loss;
  return s / static_cast<double>(end - begin);
}

TEST(Trainer, LossFallsAndEvalAccuracyRises) {
  test::TempDir dir("trainer-learn");
  const fs::path model = write_model_config(dir.path(), 64, 2, 2);
  const fs::path run = dir / "run";
  const Config cfg = make_config(base_config(run, model,
                                             "data.eval = \"" + data().eval.string() + "\"\n"
                                             "train.global_batch = 16\n"
                                             "train.max_steps = 150\n"
                                             "optim.lr = 0.05\n"
                                             "schedule.warmup_steps = 10\n"
                                             "eval.interval_samples = 800\n"
                                             "eval.max_samples = 128\n"
                                             "log.interval_steps = 25\n"));
  Trainer trainer(cfg, StartMode::kFresh);
  const TrainSummary s = trainer.run();
  ASSERT_EQ(s.steps.size(), 150u);
  const double first = mean_mlm_loss(s.steps, 0, 10), last = mean_mlm_loss(s.steps, 140, 150);
  std::printf("mlm loss: first 10 steps %.4f, last 10 steps %.4f; eval mlm accuracy %.4f -> %.4f\n", first, last,
              s.evals.front().mlm_accuracy, s.evals.back().mlm_accuracy);
  EXPECT_GT(first, 10.0);  // ~ln(30522) = 10.33 at initialisation
  EXPECT_LT(last, 7.5);
  ASSERT_EQ(s.evals.size(), 3u);  // after 800 and 1600 samples, and at the end (2400)
  // Observed: 0.069, 0.069, 0.053 (the model has learnt the frequent tokens); an untrained model scores ~1/30522.
  for (const EvalResult& e : s.evals) EXPECT_GT(e.mlm_accuracy, 0.04);
  {
    ops::CpuBackend<ops::CpuF32> backend(2);
    const Dataset eval_data(data().eval);
    BertModel<ops::CpuF32> untrained(BertConfig::from_file(model.string()), backend, 16 * 128, 16, 16 * 20);
    untrained.init_params(12345);
    const EvalResult e0 = evaluate(untrained, eval_data, 128, 16);
    EXPECT_LT(e0.mlm_accuracy, 0.01);
    EXPECT_EQ(e0.samples, 128u);
  }

  // metrics.jsonl: 6 step lines (every 25) and 3 eval lines, with the documented fields.
  std::istringstream lines(read_file(run / "metrics.jsonl"));
  std::string line;
  int step_lines = 0, eval_lines = 0;
  while (std::getline(lines, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("eval")) {
      ++eval_lines;
      for (const char* k : {"step", "samples", "mlm_accuracy", "nsp_accuracy", "eval_loss"}) EXPECT_TRUE(j.contains(k));
    } else {
      ++step_lines;
      for (const char* k : {"step", "samples", "loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "lr", "grad_norm",
                            "seq_per_s", "tokens_per_s", "elapsed_s"})
        EXPECT_TRUE(j.contains(k)) << k;
    }
  }
  EXPECT_EQ(step_lines, 6);
  EXPECT_EQ(eval_lines, 3);
  EXPECT_TRUE(fs::exists(run / "config.toml"));
  EXPECT_EQ(latest_checkpoint(run).filename(), "step_00000150");
}

TEST(Trainer, StopAndResumeIsBitIdentical) {
  test::TempDir dir("trainer-resume");
  const fs::path model = write_model_config(dir.path(), 32, 1, 2);
  // 8 steps of batch 8 in 2 micro-batches; the schedule is fixed at 8 steps for both runs.
  const std::string common = "train.global_batch = 8\ntrain.grad_accumulation = 2\nschedule.total_steps = 8\n"
                             "schedule.warmup_steps = 2\noptim.lr = 0.02\nlog.interval_steps = 1\n";
  const fs::path run_a = dir / "a", run_b = dir / "b";
  Trainer a(make_config(base_config(run_a, model, common + "train.max_steps = 8\n")), StartMode::kFresh);
  const TrainSummary sa = a.run();

  TrainSummary sb1, sb2;
  {
    Trainer b(make_config(base_config(run_b, model, common + "train.max_steps = 3\n")), StartMode::kFresh);
    sb1 = b.run();
  }
  const std::string again = base_config(run_b, model, common + "train.max_steps = 8\n");
  // A run_dir with a checkpoint refuses a fresh start.
  const std::string refused = error_of([&] { Trainer(make_config(again), StartMode::kFresh); });
  EXPECT_NE(refused.find("pass --resume to continue it or --overwrite"), std::string::npos) << refused;
  Trainer b2(make_config(again), StartMode::kResume);
  sb2 = b2.run();

  ASSERT_EQ(sa.steps.size(), 8u);
  ASSERT_EQ(sb1.steps.size(), 3u);
  ASSERT_EQ(sb2.steps.size(), 5u);
  EXPECT_EQ(sb2.first_step, 3);
  for (size_t i = 0; i < 8; ++i) {
    const StepRecord& r = i < 3 ? sb1.steps[i] : sb2.steps[i - 3];
    EXPECT_EQ(sa.steps[i].step, r.step);
    EXPECT_EQ(sa.steps[i].loss, r.loss) << "step " << i + 1;
    EXPECT_EQ(sa.steps[i].mlm_loss, r.mlm_loss) << "step " << i + 1;
    EXPECT_EQ(sa.steps[i].grad_norm, r.grad_norm) << "step " << i + 1;
    EXPECT_EQ(sa.steps[i].lr, r.lr) << "step " << i + 1;
  }
  EXPECT_LT(sa.steps[7].loss, sa.steps[0].loss);
  EXPECT_EQ(a.params(), b2.params());
  EXPECT_EQ(sb2.samples, 64u);

  // metrics.jsonl of the resumed run reads as one run: steps 1..8 once each.
  std::istringstream lines(read_file(run_b / "metrics.jsonl"));
  std::string line;
  std::vector<int64_t> steps;
  while (std::getline(lines, line)) steps.push_back(nlohmann::json::parse(line).at("step").get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));

  // --overwrite starts over.
  Trainer c(make_config(base_config(run_b, model, common + "train.max_steps = 2\n")), StartMode::kOverwrite);
  EXPECT_EQ(c.run().steps.front().loss, sa.steps.front().loss);
  EXPECT_EQ(list_checkpoints(run_b).size(), 1u);
}

TEST(Trainer, BadInputsAreClearErrorsAndWriteNothing) {
  test::TempDir dir("trainer-bad");
  const fs::path good_model = write_model_config(dir.path(), 32, 1, 2);
  const fs::path run = dir / "run";
  auto expect_error = [&](const std::string& config_text, const std::string& needle) {
    SCOPED_TRACE(needle);
    const std::string e = error_of([&] { Trainer(make_config(config_text), StartMode::kFresh); });
    EXPECT_NE(e.find(needle), std::string::npos) << e;
    EXPECT_FALSE(fs::exists(run)) << "run_dir was created";
  };
  expect_error(base_config(run, write_model_config(dir.path(), 32, 1, 3)),
               "model.config " + (dir / "model-32-3-30522-128.json").string() +
                   ": config: hidden_size 32 is not divisible by num_attention_heads 3");
  expect_error(base_config(run, write_model_config(dir.path(), 32, 1, 2, 1000)),
               "vocab_size 1000 is smaller than the vocabulary of data.train");
  expect_error(base_config(run, write_model_config(dir.path(), 32, 1, 2, 30522, 64)),
               "max_position_embeddings 64 is smaller than the longest sequence of data.train");
  expect_error(base_config(run, dir / "nope.json"), "model.config " + (dir / "nope.json").string() + ": cannot open");
  expect_error(base_config(run, good_model, "data.eval = \"" + (dir / "missing").string() + "\"\n"),
               "data.eval: " + (dir / "missing").string() + " does not exist");
  expect_error(base_config(run, good_model, "train.global_batch = 10\ntrain.grad_accumulation = 3\n"),
               "train.global_batch (10) must be a multiple of train.grad_accumulation (3)");
  expect_error(base_config(run, good_model, "train.global_batch = 0\n"), "train.global_batch must be positive");
  expect_error(base_config(run, good_model, "optim.name = \"sgd\"\n"), "optim.name must be lamb or adamw");
  expect_error(base_config(run, good_model, "init_from = \"" + (dir / "none.safetensors").string() + "\"\n"),
               "init_from: init weights: " + (dir / "none.safetensors").string() + " does not exist");

  // Unknown key: the schema rejects it, naming it.
  const std::string unknown = error_of([&] { make_config(base_config(run, good_model, "train.global_bacth = 4\n")); });
  EXPECT_NE(unknown.find("train.global_bacth"), std::string::npos) << unknown;

  // A run_dir below a regular file.
  std::ofstream(dir / "plain") << "x";
  const std::string unwritable =
      error_of([&] { Trainer(make_config(base_config(dir / "plain" / "run", good_model)), StartMode::kFresh); });
  EXPECT_NE(unwritable.find("run_dir: "), std::string::npos) << unwritable;

  // init_from whose shapes do not fit model.config.
  {
    BertConfig other = BertConfig::from_file(write_model_config(dir.path(), 48, 1, 2).string());
    const ParamLayout layout(other);
    std::vector<float> p(layout.total_numel(), 0.0f);
    std::vector<SafetensorsTensor> ts;
    for (const auto& t : layout.tensors()) ts.push_back({t.name, DType::kF32, t.shape, p.data() + t.offset});
    write_safetensors(dir / "other.safetensors", ts);
  }
  expect_error(base_config(run, good_model, "init_from = \"" + (dir / "other.safetensors").string() + "\"\n"),
               "tensor bert.embeddings.word_embeddings.weight has shape [30522, 48], the model (model.config) "
               "expects [30522, 32]");

  // A run to resume, then a missing and a corrupted checkpoint file.
  const std::string resumable = base_config(run, good_model, "train.global_batch = 4\ntrain.max_steps = 1\n");
  Trainer(make_config(resumable), StartMode::kFresh).run();
  const fs::path ck = latest_checkpoint(run);
  fs::rename(ck / "optimizer.safetensors", dir / "saved");
  std::string e = error_of([&] { Trainer(make_config(resumable), StartMode::kResume); });
  EXPECT_NE(e.find("file optimizer.safetensors is missing"), std::string::npos) << e;
  fs::rename(dir / "saved", ck / "optimizer.safetensors");
  fs::copy_file(ck / "model.safetensors", dir / "model.copy");
  {
    std::fstream io(ck / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(1000);
    io.put('\x7f');
  }
  e = error_of([&] { Trainer(make_config(resumable), StartMode::kResume); });
  EXPECT_NE(e.find("file model.safetensors is corrupted"), std::string::npos) << e;
  fs::copy_file(dir / "model.copy", ck / "model.safetensors", fs::copy_options::overwrite_existing);
  // A resumed run with another architecture.
  e = error_of([&] {
    Trainer(make_config(base_config(run, write_model_config(dir.path(), 32, 1, 4))), StartMode::kResume);
  });
  EXPECT_NE(e.find("model config differs from the run's model.config"), std::string::npos) << e;
  EXPECT_NE(e.find("num_attention_heads: 4 vs 2"), std::string::npos) << e;
  EXPECT_NO_THROW(Trainer(make_config(resumable), StartMode::kResume));
}

// A run folder whose checkpoints/latest is gone still holds a run: a new run neither prunes its checkpoint folders nor
// replaces its metrics unless --overwrite says so, and a bad value found at start-up deletes nothing even with
// --overwrite.
TEST(Trainer, ARunWithoutLatestIsNotTakenOver) {
  test::TempDir dir("trainer-no-latest");
  const fs::path model = write_model_config(dir.path(), 32, 1, 2);
  const fs::path run = dir / "run";
  const std::string two_steps =
      base_config(run, model, "train.global_batch = 4\ntrain.max_steps = 2\ncheckpoint.interval_steps = 1\n");
  Trainer(make_config(two_steps), StartMode::kFresh).run();
  ASSERT_EQ(list_checkpoints(run).size(), 2u);
  const std::string metrics_before = read_file(run / "metrics.jsonl");
  fs::remove(checkpoints_dir(run) / "latest");
  const std::string longer =
      base_config(run, model, "train.global_batch = 4\ntrain.max_steps = 6\ncheckpoint.interval_steps = 1\n"
                              "checkpoint.keep = 1\n");
  for (const StartMode mode : {StartMode::kFresh, StartMode::kResume}) {
    const std::string e = error_of([&] { Trainer(make_config(longer), mode); });
    EXPECT_NE(e.find("holds checkpoint folders (the newest step_00000002) but no checkpoints/latest"),
              std::string::npos) << e;
    EXPECT_NE(e.find("--overwrite"), std::string::npos) << e;
    EXPECT_EQ(list_checkpoints(run).size(), 2u);
    EXPECT_EQ(read_file(run / "metrics.jsonl"), metrics_before);
  }
  // A run stopped before its first checkpoint: its metrics.jsonl alone refuses a fresh start.
  const fs::path early = dir / "early";
  fs::create_directories(early);
  write_file_atomic(early / "metrics.jsonl", "{\"step\":1,\"loss\":10.5}\n");
  const std::string e = error_of([&] { Trainer(make_config(base_config(early, model)), StartMode::kFresh); });
  EXPECT_NE(e.find("already holds a run's metrics.jsonl"), std::string::npos) << e;
  // --overwrite with a value that is only checked at start-up: the old run stays whole.
  const std::string bad_division = base_config(run, model, "mllog.submission_division = \"x\"\n");
  const std::string e2 = error_of([&] { Trainer(make_config(bad_division), StartMode::kOverwrite); });
  EXPECT_NE(e2.find("mllog.submission_division must be closed or open"), std::string::npos) << e2;
  EXPECT_EQ(list_checkpoints(run).size(), 2u);
  EXPECT_EQ(read_file(run / "metrics.jsonl"), metrics_before);
  EXPECT_EQ(read_file(run / "config.toml").find("\"x\""), std::string::npos);
  // A model with one segment type cannot read pre-training sequences (segments A and B).
  nlohmann::json one_type = nlohmann::json::parse(read_file(model));
  one_type["type_vocab_size"] = 1;
  write_file_atomic(dir / "one-type.json", one_type.dump());
  const std::string e3 =
      error_of([&] { Trainer(make_config(base_config(dir / "fresh", dir / "one-type.json")), StartMode::kFresh); });
  EXPECT_NE(e3.find("type_vocab_size 1 is below 2"), std::string::npos) << e3;
  EXPECT_FALSE(fs::exists(dir / "fresh"));
}

// init_from a TensorFlow checkpoint (the form of MLPerf's phase-1 checkpoint): the run starts from its weights.
// One step at a learning rate of 1e-20 leaves them as they were, so the run's checkpoint must hold the values numpy
// computed for the fixture under Hugging Face names.
TEST(Trainer, InitFromATensorFlowCheckpoint) {
  test::TempDir dir("trainer-tf");
  const fs::path tf_dir = test::source_dir() / "tests/data/tf-bert-checkpoint";
  const fs::path run = dir / "run";
  Trainer(make_config(base_config(run, tf_dir / "bert_config.json",
                                  "init_from = \"" + tf_dir.string() + "\"\ntrain.global_batch = 4\n"
                                  "train.max_steps = 1\noptim.lr = 1e-20\n")),
          StartMode::kFresh)
      .run();
  const LoadedCheckpoint ck = load_checkpoint(latest_checkpoint(run));
  const ParamLayout layout(ck.config);
  const SafetensorsFile expected(tf_dir / "expected.safetensors");
  for (const ParamTensor& t : layout.tensors()) {
    SCOPED_TRACE(t.name);
    const std::vector<float> want = expected.read_float(t.name);
    float worst = 0;
    for (size_t i = 0; i < t.numel; ++i) worst = std::max(worst, std::fabs(ck.params[t.offset + i] - want[i]));
    EXPECT_LT(worst, 1e-6f);
  }

  // A model.config the checkpoint does not fit: one error naming the variable and both shapes, nothing written.
  const fs::path run2 = dir / "run2";
  const std::string e = error_of([&] {
    Trainer(make_config(base_config(run2, write_model_config(dir.path(), 32, 2, 2),
                                    "init_from = \"" + (tf_dir / "model.ckpt-3").string() + "\"\n")),
            StartMode::kFresh);
  });
  EXPECT_NE(e.find("init_from: TensorFlow checkpoint " + (tf_dir / "model.ckpt-3").string() +
                   ": variable bert/embeddings/word_embeddings has shape [30522, 8], the model (model.config) "
                   "expects [30522, 32]"),
            std::string::npos)
      << e;
  EXPECT_FALSE(fs::exists(run2));
}

TEST(Trainer, NonFiniteLossStopsNamingTheStepAndKeepsTheLastCheckpoint) {
  test::TempDir dir("trainer-nan");
  const fs::path model = write_model_config(dir.path(), 32, 1, 2);
  const fs::path run = dir / "run";
  TrainHooks hooks;
  hooks.after_forward = [](int64_t step, StepResult& r) {
    if (step == 3) r.loss = std::numeric_limits<double>::quiet_NaN();
  };
  Trainer t(make_config(base_config(run, model, "train.global_batch = 4\ntrain.max_steps = 6\n"
                                                "checkpoint.interval_steps = 2\n")),
            StartMode::kFresh, hooks);
  const std::string e = error_of([&] { t.run(); });
  EXPECT_NE(e.find("step 3: the loss is not finite"), std::string::npos) << e;
  EXPECT_NE(e.find("step_00000002"), std::string::npos) << e;
  EXPECT_EQ(latest_checkpoint(run).filename(), "step_00000002");
  EXPECT_EQ(load_checkpoint(latest_checkpoint(run)).state.step, 2);

  // A real divergence: an absurd learning rate.
  const fs::path run2 = dir / "run2";
  Trainer t2(make_config(base_config(run2, model, "train.global_batch = 4\ntrain.max_steps = 20\noptim.lr = 1e30\n"
                                                  "checkpoint.interval_steps = 1\n")),
             StartMode::kFresh);
  const std::string e2 = error_of([&] { t2.run(); });
  EXPECT_NE(e2.find("not finite"), std::string::npos) << e2;
  EXPECT_NE(e2.find("step "), std::string::npos) << e2;
  const fs::path kept = latest_checkpoint(run2);
  ASSERT_FALSE(kept.empty());
  EXPECT_NO_THROW(load_checkpoint(kept));
}

// Loss scaling by a power of two is exact in fp32: a run with a fixed scale of 2^10 takes bit-identical steps.
TEST(Trainer, FixedLossScaleOfAPowerOfTwoChangesNothingInFp32) {
  test::TempDir dir("trainer-scale");
  const fs::path model = write_model_config(dir.path(), 32, 1, 2);
  const std::string extra = "train.global_batch = 4\ntrain.max_steps = 4\n";
  const TrainSummary a = Trainer(make_config(base_config(dir / "a", model, extra)), StartMode::kFresh).run();
  const TrainSummary b =
      Trainer(make_config(base_config(dir / "b", model, extra + "train.loss_scale = \"1024\"\n")), StartMode::kFresh)
          .run();
  ASSERT_EQ(a.steps.size(), 4u);
  ASSERT_EQ(b.steps.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(a.steps[i].grad_norm, b.steps[i].grad_norm) << "step " << i + 1;
  }
}

// A dynamic loss scale: an overflowing step is skipped, the scale halves, the run goes on, the log says so, and the
// scaler's state is checkpointed; when overflows persist down to the floor the run stops as diverged.
TEST(Trainer, DynamicLossScaleSkipsOverflowsAndStopsWhenExhausted) {
  test::TempDir dir("trainer-dyn");
  const fs::path model = write_model_config(dir.path(), 32, 1, 2);
  const fs::path run = dir / "run";
  TrainHooks hooks;
  hooks.after_forward = [](int64_t step, StepResult& r) {
    if (step == 3) r.loss = std::numeric_limits<double>::infinity();
  };
  Trainer t(make_config(base_config(run, model, "train.global_batch = 4\ntrain.max_steps = 6\n"
                                                "train.loss_scale = \"dynamic\"\ntrain.loss_scale_init = 1024\n"
                                                "log.interval_steps = 1\n")),
            StartMode::kFresh, hooks);
  const TrainSummary sum = t.run();
  EXPECT_EQ(sum.final_step, 6);
  std::ifstream f(run / "metrics.jsonl");
  std::string line;
  std::vector<nlohmann::json> lines;
  while (std::getline(f, line)) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_EQ(lines[1]["loss_scale"], 1024.0);
  EXPECT_EQ(lines[2]["skipped"], true);
  EXPECT_TRUE(lines[2]["loss"].is_null());  // written as JSON null, not a bare inf
  EXPECT_EQ(lines[2]["loss_scale"], 1024.0);
  // Step 4 was enqueued before step 3 was read: it ran at 1024 too; step 5 runs at the halved scale.
  EXPECT_EQ(lines[3]["skipped"], false);
  EXPECT_EQ(lines[4]["loss_scale"], 512.0);
  const LoadedCheckpoint ck = load_checkpoint(latest_checkpoint(run));
  ASSERT_TRUE(ck.state.extra.contains("loss_scale"));
  EXPECT_EQ(ck.state.extra["loss_scale"]["scale"], 512.0);
  EXPECT_EQ(ck.state.extra["loss_scale"]["overflows"], 1);

  TrainHooks always;
  always.after_forward = [](int64_t step, StepResult& r) {
    if (step >= 2) r.loss = std::numeric_limits<double>::quiet_NaN();
  };
  Trainer t2(make_config(base_config(dir / "run2", model, "train.global_batch = 4\ntrain.max_steps = 40\n"
                                                          "train.loss_scale = \"dynamic\"\n"
                                                          "train.loss_scale_init = 8\n")),
             StartMode::kFresh, always);
  const std::string e = error_of([&] { t2.run(); });
  EXPECT_NE(e.find("overflow even at loss scale"), std::string::npos) << e;
  EXPECT_NE(e.find("training diverged"), std::string::npos) << e;
}

TEST(Trainer, PrecisionAndLossScaleKeysAreChecked) {
  test::TempDir dir("trainer-prec");
  const fs::path model = write_model_config(dir.path(), 32, 1, 2);
  std::string e = error_of([&] {
    Trainer(make_config(base_config(dir / "r", model, "train.precision = \"fp16\"\n")), StartMode::kFresh);
  });
  EXPECT_NE(e.find("train.precision fp16 needs a GPU"), std::string::npos) << e;
  e = error_of([&] {
    Trainer(make_config(base_config(dir / "r", model, "train.precision = \"fp8\"\n")), StartMode::kFresh);
  });
  EXPECT_NE(e.find("train.precision must be auto, fp32, bf16 or fp16"), std::string::npos) << e;
  e = error_of([&] {
    Trainer(make_config(base_config(dir / "r", model, "train.loss_scale = \"lots\"\n")), StartMode::kFresh);
  });
  EXPECT_NE(e.find("train.loss_scale must be auto, dynamic, none or a positive number"), std::string::npos) << e;
  e = error_of([&] {
    Trainer(make_config(base_config(dir / "r", model, "train.loss_scale = \"dynamic\"\n"
                                                      "train.loss_scale_window = 0\n")),
            StartMode::kFresh);
  });
  EXPECT_NE(e.find("growth_interval must be positive"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(dir / "r"));
}

}  // namespace
}  // namespace nopad
