// Philox-4x32-10 against the Random123 known-answer vectors, and the statistics and keying of the dropout masks.
#include <gtest/gtest.h>

#include <cmath>

#include "core/philox.h"

namespace nopad {
namespace {

// Known-answer vectors from Random123's kat_vectors (philox4x32 10: counter[4] key[2] -> output[4]).
TEST(Philox, KnownAnswerVectors) {
  struct Case {
    uint32_t ctr[4], key[2], out[4];
  };
  const Case cases[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Case& c : cases) {
    const Philox4x32 r = philox4x32(c.ctr, c.key);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(r.v[i], c.out[i]) << "word " << i;
  }
}

TEST(Philox, KeepRateMatchesProbability) {
  for (float p : {0.1f, 0.5f}) {
    const int n = 1 << 20;
    int kept = 0;
    double sum_u = 0;
    for (int e = 0; e < n; ++e) {
      kept += dropout_keep(/*seed=*/1234, /*step=*/7, /*op_id=*/3, /*sample_id=*/e / 4096, element_hidden(e % 4096, 0), p);
      sum_u += dropout_uniform(99, 1, 2, 5, static_cast<uint64_t>(e));
    }
    const double rate = static_cast<double>(kept) / n;
    const double sigma = std::sqrt(p * (1 - p) / n);  // binomial standard deviation of the rate
    EXPECT_NEAR(rate, 1.0 - p, 5 * sigma) << "p=" << p;
    EXPECT_NEAR(sum_u / n, 0.5, 5 * std::sqrt(1.0 / 12 / n));
  }
}

TEST(Philox, MaskIsAFunctionOfSampleAndElementOnly) {
  // Same key -> same bits; changing any key part changes the stream.
  int same = 0, diff_sample = 0, diff_step = 0, diff_op = 0, diff_seed = 0;
  for (uint64_t e = 0; e < 1000; ++e) {
    const float u = dropout_uniform(1, 2, 3, 77, e);
    same += u == dropout_uniform(1, 2, 3, 77, e);
    diff_sample += u != dropout_uniform(1, 2, 3, 78, e);
    diff_step += u != dropout_uniform(1, 3, 3, 77, e);
    diff_op += u != dropout_uniform(1, 2, 4, 77, e);
    diff_seed += u != dropout_uniform(2, 2, 3, 77, e);
  }
  EXPECT_EQ(same, 1000);
  EXPECT_GE(diff_sample, 995);
  EXPECT_GE(diff_step, 995);
  EXPECT_GE(diff_op, 995);
  EXPECT_GE(diff_seed, 995);
  // p = 0 keeps everything; uniform values lie in [0, 1).
  EXPECT_TRUE(dropout_keep(1, 2, 3, 4, 5, 0.0f));
  EXPECT_LT(uniform_from_bits(0xffffffffu), 1.0f);
  EXPECT_EQ(uniform_from_bits(0), 0.0f);
  // Element keys keep their parts apart.
  EXPECT_NE(element_attention(0, 1, 0), element_attention(0, 0, 1));
  EXPECT_NE(element_attention(1, 0, 0), element_attention(0, 1, 0));
  EXPECT_NE(element_hidden(1, 0), element_hidden(0, 1));
}

}  // namespace
}  // namespace nopad
