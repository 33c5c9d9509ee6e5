// Dynamic loss scaling: backoff on overflow, growth after a window of applied steps, one backoff per overflow even
// when steps are read one step late, the divergence floor, option checks and the checkpoint round trip.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "train/loss_scale.h"

namespace nopad {
namespace {

TEST(LossScale, BacksOffOnOverflowAndGrowsAfterTheWindow) {
  LossScaleOptions o;
  o.init = 1024;
  o.growth_interval = 3;
  DynamicLossScale s(o);
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_TRUE(s.update(1024, true));
  EXPECT_EQ(s.scale(), 512);
  EXPECT_FALSE(s.update(512, false));
  EXPECT_FALSE(s.update(512, false));
  EXPECT_EQ(s.scale(), 512);
  s.update(512, false);  // third applied step in a row
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.good_steps(), 0);
  EXPECT_EQ(s.overflows(), 1);
}

TEST(LossScale, OneOverflowLowersTheScaleOnceWhenReadLate) {
  DynamicLossScale s(LossScaleOptions{});
  const double first = s.scale();
  // Steps N and N+1 were both enqueued at `first`; both overflow; they are read after both ran.
  EXPECT_TRUE(s.update(first, true));
  EXPECT_FALSE(s.update(first, true));  // N+1 ran before the backoff: no second backoff
  EXPECT_EQ(s.scale(), first / 2);
  EXPECT_EQ(s.overflows(), 2);
  // A late good step at the old scale does not count towards growth at the new one.
  EXPECT_FALSE(s.update(first, false));
  EXPECT_EQ(s.good_steps(), 0);
  // The next overflow at the new scale lowers it again.
  EXPECT_TRUE(s.update(first / 2, true));
  EXPECT_EQ(s.scale(), first / 4);
}

TEST(LossScale, RepeatedOverflowsExhaustTheScale) {
  LossScaleOptions o;
  o.init = 8;
  o.min_scale = 1;
  DynamicLossScale s(o);
  int backoffs = 0;
  while (!s.exhausted()) backoffs += s.update(s.scale(), true);
  EXPECT_EQ(backoffs, 4);  // 8 -> 4 -> 2 -> 1 -> 0.5
  EXPECT_LT(s.scale(), 1);
}

TEST(LossScale, GrowthStopsAtTheMaximum) {
  LossScaleOptions o;
  o.init = 4;
  o.max_scale = 8;
  o.growth_interval = 1;
  DynamicLossScale s(o);
  for (int i = 0; i < 5; ++i) s.update(s.scale(), false);
  EXPECT_EQ(s.scale(), 8);
}

TEST(LossScale, BadOptionsAndStateAreClearErrors) {
  auto message = [](LossScaleOptions o) {
    try {
      DynamicLossScale s(o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  LossScaleOptions o;
  o.backoff = 1.5;
  EXPECT_NE(message(o).find("backoff must be in (0, 1)"), std::string::npos);
  o = {};
  o.init = 0;
  EXPECT_NE(message(o).find("init must be a positive number"), std::string::npos);
  o = {};
  o.growth_interval = 0;
  EXPECT_NE(message(o).find("growth_interval must be positive"), std::string::npos);

  DynamicLossScale s(LossScaleOptions{});
  s.update(s.scale(), true);
  s.update(s.scale(), false);
  DynamicLossScale t(LossScaleOptions{});
  t.load_json(s.to_json());
  EXPECT_EQ(t.scale(), s.scale());
  EXPECT_EQ(t.good_steps(), 1);
  EXPECT_EQ(t.overflows(), 1);
  EXPECT_THROW(t.load_json(nlohmann::json{{"scale", -1}, {"good_steps", 0}, {"overflows", 0}}), Error);
  EXPECT_THROW(t.load_json(nlohmann::json{{"scale", 2}}), Error);
}

}  // namespace
}  // namespace nopad
