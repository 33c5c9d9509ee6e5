// The trainer's device engines: the CPU engine reproduces the plain CPU loop (BertModel<CpuF32> + CpuBackend + LAMB)
// bit for bit, and train.device is resolved (auto -> cpu without a GPU) or refused with one clear error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>

#include "core/error.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "ops/cpu/cpu_backend.h"
#include "model/bert.h"
#include "optim/optimizer.h"
#include "test_util.h"
#include "train/engine.h"
#include "train/trainer.h"

namespace nopad {
namespace {

namespace fs = std::filesystem;

constexpr int kMaxLen = 64;

struct EngineFixtureData {
  test::TempDir dir{"engine"};
  fs::path data, model;
  EngineFixtureData() {
    data = dir / "data";
    fs::create_directories(data);
    test::write_random_dataset(data, 48, 1, 7, kMaxLen);
    nlohmann::json j = {{"hidden_size", 32},      {"num_hidden_layers", 1},           {"num_attention_heads", 2},
                        {"intermediate_size", 128}, {"vocab_size", 30522},             {"max_position_embeddings", kMaxLen},
                        {"type_vocab_size", 2},   {"model_type", "bert"}};
    model = dir / "model.json";
    std::ofstream(model) << j.dump(2);
  }
  // A one-thread CPU engine for batches of 4 sequences of this data.
  EngineOptions engine_options() const {
    EngineOptions o;
    o.config = BertConfig::from_file(model);
    o.max_tokens = 4 * kMaxLen;
    o.max_seqs = 4;
    o.max_masked = 4 * kMaxLen;
    o.threads = 1;
    return o;
  }
  std::string config(const fs::path& run, const std::string& extra) const {
    std::ostringstream s;
    s << "run_dir = \"" << run.string() << "\"\n"
      << "model.config = \"" << model.string() << "\"\n"
      << "data.train = \"" << data.string() << "\"\n"
      << "train.threads = 2\ntrain.global_batch = 8\ntrain.max_steps = 4\ntrain.seed = 99\n"
      << "optim.lr = 0.02\nlog.interval_steps = 1000\n"
      << extra;
    return s.str();
  }
};

using test::error_of;

TEST(Engine, CpuTrainerMatchesThePlainCpuLoopExactly) {
  const EngineFixtureData s;
  const fs::path run = s.dir / "run";
  Trainer t(Config::parse(s.config(run, "train.device = \"cpu\"\n"), train_config_schema(), "test"),
            StartMode::kFresh);
  const TrainSummary sum = t.run();
  ASSERT_EQ(sum.steps.size(), 4u);

  // The same run written directly against the model and optimizer (the trainer's loop before engines).
  const Dataset ds(s.data);
  const BertConfig cfg = BertConfig::from_file(s.model);
  uint32_t most_masked = 0;
  for (size_t i = 0; i < ds.shard(0).num_seqs(); ++i) most_masked = std::max(most_masked, ds.shard(0).num_masked(i));
  ops::CpuBackend<ops::CpuF32> backend(2);
  BertModel<ops::CpuF32> model(cfg, backend, 8 * static_cast<int32_t>(ds.max_seq_length()), 8,
                               8 * static_cast<int32_t>(most_masked));
  model.init_params(99);
  std::vector<ParamView> views;
  for (const ParamTensor& p : model.layout().tensors())
    views.push_back({p.name, model.params() + p.offset, model.grads() + p.offset, p.numel, p.no_weight_decay});
  OptimizerOptions oo;
  oo.threads = 2;
  auto opt = make_optimizer("lamb", std::move(views), oo);
  LoaderOptions lo;
  lo.global_batch = 8;
  lo.seed = 99;
  Loader loader(ds, lo);
  for (int64_t step = 0; step < 4; ++step) {
    const HostBatch& b = loader.next();
    model.zero_grad();
    const StepResult r = model.forward(b, true, 99, static_cast<uint64_t>(step),
                                       {std::max(1.0, static_cast<double>(b.num_masked())),
                                        static_cast<double>(b.num_seqs())});
    model.backward(1.0);
    const StepStats st = opt->step(sum.steps[static_cast<size_t>(step)].lr, 1.0);
    EXPECT_EQ(sum.steps[static_cast<size_t>(step)].loss, r.loss) << "step " << step + 1;
    EXPECT_EQ(sum.steps[static_cast<size_t>(step)].mlm_loss, r.mlm_loss) << "step " << step + 1;
    EXPECT_EQ(sum.steps[static_cast<size_t>(step)].grad_norm, st.grad_norm) << "step " << step + 1;
  }
  std::vector<float> host(model.num_params());
  model.get_params(host.data());
  EXPECT_EQ(t.params(), host);
}

TEST(Engine, CpuEngineOptimizerStateRoundTrips) {
  const EngineFixtureData s;
  EngineOptions o = s.engine_options();
  auto a = make_cpu_engine(o), b = make_cpu_engine(o);
  EXPECT_NE(a->device_name().find("cpu (1 threads)"), std::string::npos) << a->device_name();
  a->init_params(5);
  const Dataset ds(s.data);
  LoaderOptions lo;
  lo.global_batch = 4;
  lo.background = false;
  Loader loader(ds, lo);
  a->zero_grad();
  a->micro_step(loader.next(), 1, 0, {});
  a->optimizer_step(1e-3, 1.0);
  const StepOutcome first = a->finish_step();
  ASSERT_TRUE(std::isfinite(first.result.loss));
  EXPECT_FALSE(first.stats.skipped);
  EXPECT_GT(first.stats.grad_norm, 0.0);
  std::vector<float> pa, pb;
  a->get_params(pa);
  b->set_params(pa.data());
  b->load_optimizer_state(a->optimizer_steps(), a->optimizer_state().state_tensors());
  EXPECT_EQ(b->optimizer_steps(), 1);
  const HostBatch& next = loader.next();
  for (auto* e : {a.get(), b.get()}) {
    e->zero_grad();
    e->micro_step(next, 1, 1, {});
    e->optimizer_step(1e-3, 1.0);
    (void)e->finish_step();
  }
  a->get_params(pa);
  b->get_params(pb);
  EXPECT_EQ(pa, pb);
  EXPECT_EQ(a->evaluate(next).loss, b->evaluate(next).loss);
}

// Forward results are read by ticket, in any order, one step late or more, as long as the model's result ring holds
// them; a ticket older than the ring is refused, not answered with another forward's numbers.
TEST(Engine, ModelResultsAreReadByTicket) {
  const EngineFixtureData s;
  const Dataset ds(s.data);
  const BertConfig cfg = BertConfig::from_file(s.model);
  ops::CpuBackend<ops::CpuF32> backend(1);
  BertModel<ops::CpuF32> model(cfg, backend, 4 * kMaxLen, 4, 4 * kMaxLen);
  model.init_params(3);
  model.set_result_capacity(3);
  LoaderOptions lo;
  lo.global_batch = 4;
  lo.background = false;
  Loader loader(ds, lo);
  std::vector<HostBatch> batches;
  for (int i = 0; i < 4; ++i) batches.push_back(loader.next());
  std::vector<double> expect;
  for (const HostBatch& b : batches) expect.push_back(model.forward(b, false, 0, 0).loss);
  ASSERT_NE(expect[0], expect[1]);
  std::vector<uint64_t> tickets;
  for (const HostBatch& b : batches) tickets.push_back(model.forward_async(b, false, 0, 0));
  EXPECT_EQ(model.read_result(tickets[3]).loss, expect[3]);  // newest first
  EXPECT_EQ(model.read_result(tickets[1]).loss, expect[1]);
  EXPECT_EQ(model.read_result(tickets[2]).loss, expect[2]);
  EXPECT_EQ(model.read_result().loss, expect[3]);  // the last forward
  const std::string old = error_of([&] { model.read_result(tickets[0]); });  // 4 forwards ago, ring of 3
  EXPECT_NE(old.find("raise set_result_capacity"), std::string::npos) << old;
  const std::string late = error_of([&] { model.set_result_capacity(8); });
  EXPECT_NE(late.find("before the first forward"), std::string::npos) << late;
}

// Steps are ended without waiting and read back later, oldest first; a step with a non-finite loss is not applied.
TEST(Engine, StepsAreReadBackInOrderAndAtMostTwoUnread) {
  const EngineFixtureData s;
  EngineOptions o = s.engine_options();
  auto e = make_cpu_engine(o);
  e->init_params(5);
  const Dataset ds(s.data);
  LoaderOptions lo;
  lo.global_batch = 4;
  lo.background = false;
  Loader loader(ds, lo);
  for (int step = 0; step < 2; ++step) {
    e->zero_grad();
    e->micro_step(loader.next(), 1, static_cast<uint64_t>(step), {});
    e->optimizer_step(1e-3, 1.0);
  }
  e->zero_grad();
  e->micro_step(loader.next(), 1, 2, {});
  const std::string full = error_of([&] { e->optimizer_step(1e-3, 1.0); });
  EXPECT_NE(full.find("steps unread"), std::string::npos) << full;
  const StepOutcome a = e->finish_step(), b = e->finish_step();
  EXPECT_TRUE(std::isfinite(a.result.loss) && std::isfinite(b.result.loss));
  EXPECT_NE(a.result.loss, b.result.loss);
  EXPECT_EQ(e->optimizer_steps(), 2);
  const std::string none = error_of([&] { e->finish_step(); });
  EXPECT_NE(none.find("no step to finish"), std::string::npos) << none;
}

TEST(Engine, DeviceKeyIsResolvedOrRefusedClearly) {
  EXPECT_EQ(resolve_device("cpu"), "cpu");
  const std::string bad = error_of([] { resolve_device("gpu"); });
  EXPECT_NE(bad.find("train.device must be auto, cpu or cuda"), std::string::npos) << bad;

  // Neither test build has a GPU: a CPU-only build cannot use one, a CUDA build sees none.
  EXPECT_EQ(resolve_device("auto"), "cpu");
  const std::string e = error_of([] { resolve_device("cuda"); });
  EXPECT_NE(e.find("no CUDA device: "), std::string::npos) << e;
  EXPECT_NE(e.find("use --set train.device=cpu"), std::string::npos) << e;
#ifndef NOPAD_HAVE_CUDA
  EXPECT_NE(e.find("built without the CUDA backend"), std::string::npos) << e;
#endif

  // Through the trainer: one error, nothing written.
  const EngineFixtureData s;
  const fs::path run = s.dir / "run-cuda";
  const std::string te = error_of([&] {
    Trainer(Config::parse(s.config(run, "train.device = \"cuda\"\n"), train_config_schema(), "test"),
            StartMode::kFresh);
  });
  EXPECT_NE(te.find("no CUDA device: "), std::string::npos) << te;
  EXPECT_FALSE(fs::exists(run));
}

// dist.clip = bucket on the CPU engine: with a threshold far below every bucket's norm, each bucket of the step's
// gradient is scaled to exactly threshold / ranks (so the optimizer's gradient norm is that times sqrt(buckets)),
// in the units of the gradient the optimizer applies (a loss scale changes nothing); a threshold above every bucket
// changes nothing at all (bitwise the unclipped update).
TEST(Engine, BucketClippingScalesEachBucketOfTheStep) {
  const EngineFixtureData s;
  EngineOptions o = s.engine_options();
  o.optim.max_grad_norm = 0;  // the trainer turns LAMB's clipping off with dist.clip = bucket
  ops::CpuBackend<ops::CpuF32> backend(1);
  const BertModel<ops::CpuF32> shape(o.config, backend, o.max_tokens, o.max_seqs, o.max_masked);
  const double buckets = static_cast<double>(shape.grad_buckets().size());
  ASSERT_GE(buckets, 3.0);
  const Dataset ds(s.data);
  LoaderOptions lo;
  lo.global_batch = 4;
  lo.background = false;
  Loader loader(ds, lo);
  const HostBatch batch = loader.next();

  struct Run {
    double norm;
    std::vector<float> params;
  };
  const auto run = [&](double clip, int ranks, double loss_scale) {
    EngineOptions eo = o;
    eo.bucket_clip_norm = clip;
    eo.world_size = ranks;
    auto e = make_cpu_engine(eo);
    e->init_params(5);
    e->zero_grad();
    e->micro_step(batch, 1, 0, {}, loss_scale, /*last_micro_batch=*/true);
    e->optimizer_step(1e-3, 1.0 / loss_scale);
    const StepOutcome out = e->finish_step();
    EXPECT_FALSE(out.stats.skipped);
    Run r{out.stats.grad_norm, {}};
    e->get_params(r.params);
    return r;
  };
  const Run plain = run(0, 1, 1.0);
  ASSERT_GT(plain.norm, 1e-2);
  const double c = 1e-4;
  for (const auto& [ranks, scale] : {std::pair{1, 1.0}, std::pair{1, 1024.0}, std::pair{4, 1.0}}) {
    const Run clipped = run(c, ranks, scale);
    EXPECT_NEAR(clipped.norm, c / ranks * std::sqrt(buckets), 1e-5 * c) << ranks << " ranks, loss scale " << scale;
  }
  const Run loose = run(1e6, 1, 1.0);
  EXPECT_EQ(loose.norm, plain.norm);
  EXPECT_EQ(loose.params, plain.params);
}

}  // namespace
}  // namespace nopad
