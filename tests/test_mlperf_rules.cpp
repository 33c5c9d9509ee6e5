// MLPerf BERT rules nopad encodes: the evaluation interval formula (eval.interval_samples = -1) and the shipped
// configs (every configs/*.toml loads with the trainer's schema; the phase-2 config carries the reference
// convergence point's hyper-parameters).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "core/error.h"
#include "test_util.h"
#include "train/config_file.h"
#include "train/trainer.h"

namespace nopad {
namespace {

TEST(MlperfRules, EvalIntervalFormula) {
  // floor(0.05 (230.23 B + 3e6) / 25,000) x 25,000
  EXPECT_EQ(mlperf_eval_interval(448), 150'000u);    // 155,157 -> 150,000
  EXPECT_EQ(mlperf_eval_interval(3072), 175'000u);   // 185,363 -> 175,000
  EXPECT_EQ(mlperf_eval_interval(256), 150'000u);    // 152,947
  EXPECT_EQ(mlperf_eval_interval(16384), 325'000u);  // 338,604
  EXPECT_EQ(mlperf_eval_interval(1), 150'000u);      // 150,012
  EXPECT_THROW(mlperf_eval_interval(0), Error);
}

TEST(MlperfRules, ShippedConfigsLoad) {
  const ConfigSchema schema = train_config_schema();
  int count = 0;
  for (const auto& e : std::filesystem::directory_iterator(test::source_dir() / "configs")) {
    if (e.path().extension() != ".toml") continue;
    SCOPED_TRACE(e.path().string());
    EXPECT_NO_THROW(Config::load(e.path().string(), schema));
    ++count;
  }
  EXPECT_GE(count, 3);
  const Config c = Config::load((test::source_dir() / "configs/mlperf-phase2.toml").string(), schema);
  // Relative to the config file's folder, stored absolute.
  EXPECT_EQ(std::filesystem::path(c.get_string("model.config")),
            (std::filesystem::absolute(test::source_dir()) / "data/configs/bert-large-mlperf.json").lexically_normal());
  EXPECT_EQ(c.get_int("train.global_batch"), 448);
  EXPECT_EQ(c.get_int("train.global_batch") % c.get_int("train.grad_accumulation"), 0);
  EXPECT_DOUBLE_EQ(c.get_double("optim.lr"), 4.25e-4);
  EXPECT_DOUBLE_EQ(c.get_double("optim.beta1"), 0.9);
  EXPECT_DOUBLE_EQ(c.get_double("optim.beta2"), 0.999);
  EXPECT_DOUBLE_EQ(c.get_double("optim.eps"), 1e-6);
  EXPECT_DOUBLE_EQ(c.get_double("optim.weight_decay"), 0.01);
  EXPECT_EQ(c.get_int("schedule.total_steps"), 6700);
  EXPECT_EQ(c.get_int("schedule.warmup_steps"), 0);
  EXPECT_DOUBLE_EQ(c.get_double("train.target_mlm_accuracy"), 0.720);
  EXPECT_EQ(c.get_int("eval.interval_samples"), -1);
  EXPECT_EQ(c.get_int("eval.max_samples"), 10000);
}

}  // namespace
}  // namespace nopad
