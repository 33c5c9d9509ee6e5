// Philox-4x32-10 and -7 against the Random123 known-answer vectors; the 16-bit (hidden-state) and 8-bit (attention)
// dropout draw contracts (threshold and scale arithmetic, drop fraction, field layout, keying); and the FMHA kernels'
// keep-bit exchange (ops/cuda/fmha_dropout.h) run over 32 simulated lanes against the mask the CPU twin draws.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

#include "core/philox.h"
#include "ops/cuda/fmha_dropout.h"

namespace nopad {
namespace {

// Known-answer vectors from Random123's kat_vectors (philox4x32 R: counter[4] key[2] -> output[4]) for both round
// counts nopad draws: 10 (hidden-state masks) and 7 (attention masks).
TEST(Philox, KnownAnswerVectors) {
  struct Case {
    int rounds;
    uint32_t ctr[4], key[2], out[4];
  };
  static_assert(kPhiloxRounds == 10 && kAttentionPhiloxRounds == 7, "the vectors below are for 10 and 7 rounds");
  constexpr uint32_t kOnes = 0xffffffff;
  const Case cases[] = {
      {10, {0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {10, {kOnes, kOnes, kOnes, kOnes}, {kOnes, kOnes}, {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {10,
       {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
      {7, {0, 0, 0, 0}, {0, 0}, {0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48}},
      {7, {kOnes, kOnes, kOnes, kOnes}, {kOnes, kOnes}, {0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662}},
      {7,
       {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a}},
  };
  for (const Case& c : cases) {
    const Philox4x32 r = c.rounds == kPhiloxRounds ? philox4x32(c.ctr, c.key) : philox4x32(c.ctr, c.key, c.rounds);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(r.v[i], c.out[i]) << "word " << i << " (" << c.rounds << " rounds)";
  }
}

TEST(Philox, ThresholdAndScaleArithmetic) {
  // p = 0: no draw, keep all, scale 1.
  EXPECT_EQ(dropout_threshold(0.0f), 0u);
  EXPECT_TRUE(dropout_keep(1, 2, 3, 4, 5, 0.0f, kPhiloxRounds));
  EXPECT_EQ(dropout_keep_scale(0), 1.0f);
  // p = 0.1: ceil(6553.6) = 6554; actual drop rate 6554 / 65536 = 0.1000061; scale 65536 / 58982 in float.
  EXPECT_EQ(dropout_threshold(0.1f), 6554u);
  EXPECT_NEAR(6554.0 / 65536.0, 0.1000061, 1e-7);
  EXPECT_EQ(dropout_keep_scale(6554), static_cast<float>(65536.0 / 58982.0));
  // p = 0.5: exact, threshold 32768, scale 2.
  EXPECT_EQ(dropout_threshold(0.5f), 32768u);
  EXPECT_EQ(dropout_keep_scale(32768), 2.0f);
  // The largest supported p, 1 - 2^-16: threshold 65535 keeps exactly one value of 65536, scale 65536.
  EXPECT_TRUE(dropout_p_supported(kDropoutMaxP));
  EXPECT_EQ(dropout_threshold(kDropoutMaxP), 65535u);
  EXPECT_EQ(dropout_keep_scale(65535), 65536.0f);
  // A p just above it rounds up to threshold 65536 (nothing kept): rejected, as are p >= 1, p < 0 and NaN.
  const float too_big = std::nextafter(kDropoutMaxP, 1.0f);
  EXPECT_EQ(dropout_threshold(too_big), 65536u);
  EXPECT_FALSE(dropout_p_supported(too_big));
  EXPECT_FALSE(dropout_p_supported(1.0f));
  EXPECT_FALSE(dropout_p_supported(-0.1f));
  EXPECT_FALSE(dropout_p_supported(std::nanf("")));
  EXPECT_TRUE(dropout_p_supported(0.0f));
  // The smallest positive p still drops: threshold 1.
  EXPECT_EQ(dropout_threshold(1e-30f), 1u);
  // threshold = ceil(p * 65536) exactly, on a sweep of p (checked in double).
  for (int i = 1; i < 2000; ++i) {
    const float p = static_cast<float>(i) / 2000.0f;
    EXPECT_EQ(dropout_threshold(p), static_cast<uint32_t>(std::ceil(static_cast<double>(p) * 65536.0))) << p;
  }
  // The device computes the scale as RN_float(1 / (65536 - t)) * 2^16; it must equal the host's double quotient
  // rounded to float for every threshold (here float division stands in for __frcp_rn: both are correctly rounded).
  for (uint32_t t = 0; t < 65536; ++t) {
    const float device = (1.0f / static_cast<float>(65536u - t)) * 65536.0f;
    ASSERT_EQ(device, dropout_keep_scale(t)) << "threshold " << t;
  }
  // E[mask * scale] = 1 for the exact quotient: keep probability (65536 - t) / 65536 times 65536 / (65536 - t).
  const double exact = (65536.0 - 6554.0) / 65536.0 * (65536.0 / (65536.0 - 6554.0));
  EXPECT_DOUBLE_EQ(exact, 1.0);
}

// The attention masks' 8-bit contract (core/philox.h): threshold ceil(p * 256), scale 256 / (256 - threshold).
TEST(Philox, AttentionThresholdAndScaleArithmetic) {
  EXPECT_EQ(attention_dropout_threshold(0.0f), 0u);
  EXPECT_TRUE(attention_dropout_keep(1, 2, 3, 4, 5, 0.0f));
  EXPECT_EQ(attention_dropout_keep_scale(0), 1.0f);
  EXPECT_EQ(attention_dropout_keep_fraction(0), 1.0f);
  // p = 0.1: ceil(25.6) = 26, so the mask drops 26 / 256 = 0.1015625; scale 256 / 230 in float.
  EXPECT_EQ(attention_dropout_threshold(0.1f), 26u);
  EXPECT_EQ(attention_dropout_effective_p(0.1f), 0.1015625f);
  EXPECT_EQ(attention_dropout_keep_scale(26), static_cast<float>(256.0 / 230.0));
  EXPECT_EQ(attention_dropout_keep_fraction(26), 230.0f / 256.0f);
  // Multiples of 1/256 run exactly: 0.5 -> 128, scale 2; 0.25 -> 64.
  EXPECT_EQ(attention_dropout_threshold(0.5f), 128u);
  EXPECT_EQ(attention_dropout_keep_scale(128), 2.0f);
  EXPECT_EQ(attention_dropout_effective_p(0.25f), 0.25f);
  // The largest supported p, 1 - 2^-8: threshold 255 keeps one value of 256, scale 256.
  EXPECT_TRUE(attention_dropout_p_supported(kAttentionDropoutMaxP));
  EXPECT_EQ(attention_dropout_threshold(kAttentionDropoutMaxP), 255u);
  EXPECT_EQ(attention_dropout_keep_scale(255), 256.0f);
  const float too_big = std::nextafter(kAttentionDropoutMaxP, 1.0f);
  EXPECT_EQ(attention_dropout_threshold(too_big), 256u);
  EXPECT_FALSE(attention_dropout_p_supported(too_big));
  EXPECT_FALSE(attention_dropout_p_supported(1.0f));
  EXPECT_FALSE(attention_dropout_p_supported(-0.1f));
  EXPECT_FALSE(attention_dropout_p_supported(std::nanf("")));
  EXPECT_EQ(attention_dropout_threshold(1e-30f), 1u);
  for (int i = 1; i < 2000; ++i) {
    const float p = static_cast<float>(i) / 2000.0f;
    EXPECT_EQ(attention_dropout_threshold(p), static_cast<uint32_t>(std::ceil(static_cast<double>(p) * 256.0))) << p;
  }
  // The device's RN_float(1 / (256 - t)) * 2^8 equals the host's double quotient rounded to float for every t.
  for (uint32_t t = 0; t < 256; ++t)
    ASSERT_EQ((1.0f / static_cast<float>(256u - t)) * 256.0f, attention_dropout_keep_scale(t)) << "threshold " << t;
}

TEST(Philox, AttentionDrawsDropFraction) {
  for (float p : {0.1f, 0.5f, 0.9f}) {
    const int n = 1 << 20;
    int dropped = 0;
    for (int e = 0; e < n; ++e)
      dropped += !attention_dropout_keep(/*seed=*/1234, /*step=*/7, /*op_id=*/3, /*sample_id=*/e >> 16,
                                         element_attention((e >> 12) & 15, (e >> 6) & 63, e & 63), p);
    const double q = attention_dropout_threshold(p) / 256.0;  // the exact drop probability of the contract
    const double rate = static_cast<double>(dropped) / n;
    EXPECT_NEAR(rate, q, 5 * std::sqrt(q * (1 - q) / n)) << "p=" << p;
  }
  // Every 8-bit value about equally often, and the mean (255 / 2).
  const uint64_t key = dropout_stream_key(99, 1, 2);
  std::vector<int> hist(256, 0);
  double sum = 0;
  const int n = 1 << 20;
  for (int e = 0; e < n; ++e) {
    const uint32_t v = attention_dropout_bits8(key, 5, static_cast<uint64_t>(e));
    ASSERT_LT(v, 256u);
    sum += v;
    ++hist[v];
  }
  EXPECT_NEAR(sum / n, 127.5, 5 * 256.0 / std::sqrt(12.0 * n));
  for (int b = 0; b < 256; ++b) EXPECT_NEAR(hist[b], n / 256.0, 6 * std::sqrt(n / 256.0)) << "value " << b;
}

TEST(Philox, SixteenAttentionElementsOfABlockUseSixteenDistinctBytes) {
  const uint64_t key = dropout_stream_key(5, 6, 7);
  for (uint64_t base : {uint64_t{0}, element_attention(15, 511, 496), element_attention(3, 131072 + 7, 1 << 19)}) {
    ASSERT_EQ(base % 16, 0u);
    const Philox4x32 blk = dropout_philox(key, 42, attention_dropout_block_index(base), kAttentionPhiloxRounds);
    for (int w = 0; w < 4; ++w) {  // element i is byte i & 3 of word i >> 2: together they rebuild the 4 words
      uint32_t word = 0;
      for (uint32_t b = 0; b < 4; ++b) {
        const uint64_t e = base + 4 * w + b;
        EXPECT_EQ(attention_dropout_block_index(e), attention_dropout_block_index(base)) << "one block serves all 16";
        word |= attention_dropout_bits8(key, 42, e) << (8 * b);
      }
      EXPECT_EQ(word, blk.v[w]) << "word " << w;
    }
    int equal = 0;  // the next block is another counter (each byte agrees with probability 2^-8)
    for (uint64_t i = 0; i < 16; ++i)
      equal += attention_dropout_bits8(key, 42, base + 16 + i) == attention_dropout_bits8(key, 42, base + i);
    EXPECT_LE(equal, 4);
  }
}

// Both round counts of the 16-bit draws (10: the hidden-state masks; 7 as a stream of its own), on hidden-state and
// attention elements. The attention masks' 8-bit draws: AttentionDrawsDropFraction below.
TEST(Philox, DropFractionOfAMillionDraws) {
  for (const int rounds : {kPhiloxRounds, kAttentionPhiloxRounds}) {
    const auto element = [&](int e) {  // all 8 fields of each block
      return rounds == kPhiloxRounds ? element_hidden((e >> 10) & 63, e & 1023)
                                     : element_attention((e >> 12) & 15, (e >> 6) & 63, e & 63);
    };
    for (float p : {0.1f, 0.5f, 0.9f}) {
      const int n = 1 << 20;
      int dropped = 0;
      for (int e = 0; e < n; ++e)
        dropped += !dropout_keep(/*seed=*/1234, /*step=*/7, /*op_id=*/3, /*sample_id=*/e >> 16, element(e), p, rounds);
      const double q = dropout_threshold(p) / 65536.0;  // the exact drop probability of the contract
      const double rate = static_cast<double>(dropped) / n;
      const double sigma = std::sqrt(q * (1 - q) / n);  // binomial standard deviation of the rate
      EXPECT_NEAR(rate, q, 5 * sigma) << "p=" << p << ", " << rounds << " rounds";
    }
    // The 16-bit values themselves: mean (65535 / 2) and every high-byte value used.
    const uint64_t key = dropout_stream_key(99, 1, 2);
    double sum = 0;
    std::vector<int> hist(256, 0);
    const int n = 1 << 20;
    for (int e = 0; e < n; ++e) {
      const uint32_t v = dropout_bits16(key, 5, static_cast<uint64_t>(e), rounds);
      ASSERT_LT(v, 65536u);
      sum += v;
      ++hist[v >> 8];
    }
    EXPECT_NEAR(sum / n, 32767.5, 5 * 65536.0 / std::sqrt(12.0 * n)) << rounds << " rounds";
    for (int b = 0; b < 256; ++b)
      EXPECT_NEAR(hist[b], n / 256.0, 6 * std::sqrt(n / 256.0)) << "high byte " << b << ", " << rounds << " rounds";
  }
  // The two round counts are different streams: about 1 in 65536 draws agree.
  const uint64_t key = dropout_stream_key(3, 1, 4);
  int equal = 0;
  for (uint64_t e = 0; e < 4096; ++e)
    equal += dropout_bits16(key, 8, e, kPhiloxRounds) == dropout_bits16(key, 8, e, kAttentionPhiloxRounds);
  EXPECT_LE(equal, 2);
}

TEST(Philox, EightElementsOfABlockUseEightDistinctFields) {
  const uint64_t key = dropout_stream_key(5, 6, 7);
  for (uint64_t base : {uint64_t{0}, element_hidden(3, 1016), element_attention(15, 511, 504)}) {
    ASSERT_EQ(base % 8, 0u);
    const Philox4x32 blk = dropout_philox(key, 42, dropout_block_index(base), kPhiloxRounds);
    std::set<int> fields;
    for (uint32_t i = 0; i < 8; ++i) {
      const uint64_t e = base + i;
      EXPECT_EQ(dropout_block_index(e), dropout_block_index(base)) << "one block serves all 8";
      const uint32_t v = dropout_bits16(key, 42, e, kPhiloxRounds);
      // Element i is word i >> 1, low half for even i, high half for odd i.
      const uint32_t expect = (i & 1) ? blk.v[i >> 1] >> 16 : blk.v[i >> 1] & 0xFFFF;
      EXPECT_EQ(v, expect) << "element " << i;
      fields.insert(static_cast<int>(2 * (i >> 1) + (i & 1)));
    }
    EXPECT_EQ(fields.size(), 8u);
    // The 8 values are the block's 128 bits exactly once each: together they rebuild the 4 words.
    for (int w = 0; w < 4; ++w)
      EXPECT_EQ(dropout_bits16(key, 42, base + 2 * w, kPhiloxRounds) |
                    (dropout_bits16(key, 42, base + 2 * w + 1, kPhiloxRounds) << 16),
                blk.v[w]);
    // The next block is another counter.
    EXPECT_NE(dropout_bits16(key, 42, base + 8, kPhiloxRounds), dropout_bits16(key, 42, base, kPhiloxRounds))
        << "(equal with probability 2^-16)";
  }
}

TEST(Philox, MaskIsAFunctionOfSampleAndElementOnly) {
  // Same key -> same bits; changing any key part changes the stream.
  int same = 0, diff_sample = 0, diff_step = 0, diff_op = 0, diff_seed = 0;
  auto bits = [](uint64_t seed, uint64_t step, uint32_t op, uint64_t sample, uint64_t e) {
    return dropout_bits16(dropout_stream_key(seed, step, op), sample, e, kPhiloxRounds);
  };
  for (uint64_t e = 0; e < 1000; ++e) {
    const uint32_t u = bits(1, 2, 3, 77, e);
    same += u == bits(1, 2, 3, 77, e);
    diff_sample += u != bits(1, 2, 3, 78, e);
    diff_step += u != bits(1, 3, 3, 77, e);
    diff_op += u != bits(1, 2, 4, 77, e);
    diff_seed += u != bits(2, 2, 3, 77, e);
  }
  EXPECT_EQ(same, 1000);
  EXPECT_GE(diff_sample, 990);  // a 16-bit value repeats by chance with probability 2^-16
  EXPECT_GE(diff_step, 990);
  EXPECT_GE(diff_op, 990);
  EXPECT_GE(diff_seed, 990);
  // Element keys keep their parts apart.
  EXPECT_NE(element_attention(0, 1, 0), element_attention(0, 0, 1));
  EXPECT_NE(element_attention(1, 0, 0), element_attention(0, 1, 0));
  EXPECT_NE(element_hidden(1, 0), element_hidden(0, 1));
}

// ------------------------------------------------------------------------------------------------ FMHA exchange
namespace fd = cuda::fmha_dropout;

// The carry-chain keep bits (host path of the same functions; the device path is add.cc/addc with the same meaning):
// every byte of every word against every threshold at the boundary, then random words.
TEST(FmhaDropoutExchange, KeepBitsByCarryEqualTheComparison) {
  uint64_t state = 88172645463325252ull;
  for (uint32_t threshold = 1; threshold < 256; ++threshold) {
    const uint32_t c8 = fd::keep_c8(threshold);
    const uint32_t below = threshold - 1;
    // Fields at threshold - 1 and threshold next to 0x00 or 0xFF in the other bytes, then random words.
    const uint32_t edges[] = {below * 0x01010101u, threshold * 0x01010101u, below | 0xFFFFFF00u,
                              threshold | 0xFFFFFF00u, (below << 24) | 0x00FFFFFFu, threshold << 24,
                              (below << 8) | 0xFF00FFFFu, (threshold << 16) | 0xFF00FFFFu};
    for (int i = 0; i < 2000; ++i) {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      const uint32_t v = i < 8 ? edges[i] : static_cast<uint32_t>(state);
      const Philox4x32 blk{{v, ~v, v ^ 0x5A5A5A5Au, v * 2654435761u}};
      for (int f = 0; f < 16; ++f) {
        const uint32_t acc = fd::push_field(1u, blk, f, c8);  // 1, then the field's bit
        const uint32_t field = (blk.v[f >> 2] >> (8 * (f & 3))) & 0xFF;
        ASSERT_EQ(acc, 2u | (field >= threshold ? 1u : 0u)) << v << " field " << f << " threshold " << threshold;
      }
    }
  }
}

// The kernels' exchange, simulated: 32 lanes compute their packed words with the same functions the kernels call,
// the shuffles become array reads, and every lane's bit for accumulator element (nt, e) must equal the CPU twin's
// keep decision for that (query, key).

struct Sim {
  uint64_t key = dropout_stream_key(2024, 9, 4);
  uint64_t sample = 0x1234567890abcdefull;  // both halves of the counter's sample words nonzero
  uint32_t threshold = attention_dropout_threshold(0.3f);
  Philox4x32 draw(uint32_t lo, uint32_t hi) const {
    return dropout_philox(key, sample, (static_cast<uint64_t>(hi) << 32) | lo, kAttentionPhiloxRounds);
  }
  bool keep(uint32_t head, uint32_t q, uint32_t k) const {
    return attention_dropout_keep_threshold(key, sample, element_attention(head, q, k), threshold);
  }
};

// Lane-group transpose as the kernels do it (fmha_common.cuh lane_transpose): stage b swaps with lane ^ (1 << b <<
// lane_shift).
template <int kSlotBits>
void simulate_exchange(uint32_t (&x)[32], int lane_shift, int (*index)(int lane)) {
  for (int b = 0; b < fd::xchg_stages<kSlotBits>(); ++b) {
    uint32_t sent[32], next[32];
    for (int l = 0; l < 32; ++l) sent[l] = fd::xchg_send<kSlotBits>(x[l], static_cast<uint32_t>(index(l)), b);
    for (int l = 0; l < 32; ++l)
      next[l] = fd::xchg_merge<kSlotBits>(x[l], sent[l ^ ((1 << b) << lane_shift)], static_cast<uint32_t>(index(l)), b);
    for (int l = 0; l < 32; ++l) x[l] = next[l];
  }
}

TEST(FmhaDropoutExchange, ForwardQuadTransposeGivesEveryLaneItsBits) {
  const Sim sim;
  const auto draw = [&](uint32_t lo, uint32_t hi) { return sim.draw(lo, hi); };
  int checked = 0, kept = 0;
  // Rows past 2^15 and 2^17 exercise the high counter word; heads up to 15.
  for (uint32_t head : {0u, 5u, 15u})
    for (uint32_t row16 : {0u, 48u, 32768u + 16u, 131072u + 96u})  // the warp's first row (a multiple of 16)
      for (uint32_t key_tile : {0u, 64u, 640u, 131072u + 64u}) {
        uint32_t x[32];
        for (int l = 0; l < 32; ++l)
          x[l] = fd::fwd_lane_bits(draw, sim.threshold, head, row16 + (l >> 2), key_tile, l & 3);
        simulate_exchange<4>(x, 0, [](int l) { return l & 3; });
        for (int l = 0; l < 32; ++l)
          for (int nt = 0; nt < 8; ++nt)
            for (int e = 0; e < 4; ++e) {
              const uint32_t q = row16 + (l >> 2) + 8 * (e >> 1), k = key_tile + 8 * nt + 2 * (l & 3) + (e & 1);
              const bool bit = (x[l] >> fd::fwd_bit(nt, e)) & 1;
              ASSERT_EQ(bit, sim.keep(head, q, k)) << "lane " << l << " nt " << nt << " e " << e << " q " << q
                                                   << " k " << k;
              ++checked;
              kept += bit;
            }
      }
  EXPECT_EQ(checked, 3 * 4 * 4 * 32 * 32);
  EXPECT_NEAR(static_cast<double>(kept) / checked, 1.0 - sim.threshold / 256.0, 0.02);
}

TEST(FmhaDropoutExchange, BackwardOctetTransposeGivesEveryLaneItsBits) {
  const Sim sim;
  const auto draw = [&](uint32_t lo, uint32_t hi) { return sim.draw(lo, hi); };
  int checked = 0, kept = 0;
  for (uint32_t head : {0u, 7u, 15u})
    for (uint32_t key16 : {0u, 48u, 32768u + 16u, 131072u + 112u})  // the warp's first key
      for (uint32_t q_tile : {0u, 64u, 704u, 131072u + 64u}) {
        uint32_t x[32];
        for (int l = 0; l < 32; ++l)
          x[l] = fd::bwd_lane_bits(draw, sim.threshold, head, q_tile, key16, l >> 2, l & 3);
        simulate_exchange<2>(x, 2, [](int l) { return l >> 2; });
        for (int l = 0; l < 32; ++l)
          for (int nt = 0; nt < 8; ++nt)
            for (int e = 0; e < 4; ++e) {
              const uint32_t k = key16 + (l >> 2) + 8 * (e >> 1), q = q_tile + 8 * nt + 2 * (l & 3) + (e & 1);
              const bool bit = (x[l] >> fd::bwd_bit(nt, e)) & 1;
              ASSERT_EQ(bit, sim.keep(head, q, k)) << "lane " << l << " nt " << nt << " e " << e << " q " << q
                                                   << " k " << k;
              ++checked;
              kept += bit;
            }
      }
  EXPECT_EQ(checked, 3 * 4 * 4 * 32 * 32);
  EXPECT_NEAR(static_cast<double>(kept) / checked, 1.0 - sim.threshold / 256.0, 0.02);
}

// The wgmma forward's permuted key rows (fmha_dropout::fwd_key_perm): a permutation of each 64-key tile under which
// lane t's S columns 8 nt + 2 t + h hold the 16 keys of its own blocks, field fwd_own_field(nt, e) being the twin's
// draw of that (query, key); and the copy loop's stepping (source row perm(row0) + k kStep / 4) is the permutation of
// row0 + k kStep.
TEST(FmhaDropoutExchange, ForwardKeyPermutationGivesEveryLaneItsOwnBlocks) {
  bool seen[64] = {};
  for (int c = 0; c < 64; ++c) {
    const int k = fd::fwd_key_perm(c);
    ASSERT_GE(k, 0);
    ASSERT_LT(k, 64);
    ASSERT_FALSE(seen[k]) << "column " << c;
    seen[k] = true;
  }
  for (int step : {16, 32})
    for (int row0 = 0; row0 < step; ++row0)
      for (int k = 0; row0 + k * step < 64; ++k)
        ASSERT_EQ(fd::fwd_key_perm(row0 + k * step), fd::fwd_key_perm(row0) + k * step / 4) << row0 << " " << step;
  const Sim sim;
  const auto draw = [&](uint32_t lo, uint32_t hi) { return sim.draw(lo, hi); };
  int checked = 0;
  for (uint32_t head : {0u, 11u})
    for (uint32_t row : {0u, 77u, 131072u + 9u})
      for (uint32_t key_tile : {0u, 448u})
        for (uint32_t t = 0; t < 4; ++t) {
          const Philox4x32 blk = fd::fwd_lane_block(draw, head, row, key_tile, t);
          for (int nt = 0; nt < 8; ++nt)
            for (int h = 0; h < 2; ++h) {
              const uint32_t key = key_tile + fd::fwd_key_perm(8 * nt + 2 * static_cast<int>(t) + h);
              ASSERT_EQ(key, key_tile + 16 * t + 2 * nt + h);
              ASSERT_EQ(key, key_tile + fd::fwd_permuted_key(nt, static_cast<int>(t), h));
              const int f = fd::fwd_own_field(nt, h);
              ASSERT_EQ(f >> 2, nt >> 1);  // word nt >> 1 ...
              ASSERT_EQ(f & 3, 2 * (nt & 1) + h);  // ... byte 2 (nt & 1) + h: the halves drop_fragments widens
              const uint32_t field = (blk.v[f >> 2] >> (8 * (f & 3))) & 0xFF;
              ASSERT_EQ(field >= sim.threshold, sim.keep(head, row, key)) << "t " << t << " nt " << nt << " h " << h;
              ++checked;
            }
        }
  EXPECT_EQ(checked, 2 * 3 * 2 * 4 * 16);
}

// Queries that are a subset of a sequence's rows (FmhaParams::q_positions): each row or query column of a tile carries
// an arbitrary position, and every lane must still end up with the bits of those positions.
TEST(FmhaDropoutExchange, RowsAtAnyPositionsGetTheirOwnBits) {
  const Sim sim;
  const auto draw = [&](uint32_t lo, uint32_t hi) { return sim.draw(lo, hi); };
  uint32_t pos[64];
  for (uint32_t i = 0; i < 64; ++i) pos[i] = (i * 37u + 11u) % 509u + (i == 5 ? 131072u : 0u);  // scrambled, one high
  int checked = 0;
  for (uint32_t head : {0u, 9u})
    for (uint32_t key_tile : {0u, 448u}) {
      uint32_t x[32];
      for (int l = 0; l < 32; ++l)
        x[l] = fd::fwd_lane_bits_at(draw, sim.threshold, head, pos[l >> 2], pos[(l >> 2) + 8], key_tile, l & 3);
      simulate_exchange<4>(x, 0, [](int l) { return l & 3; });
      for (int l = 0; l < 32; ++l)
        for (int nt = 0; nt < 8; ++nt)
          for (int e = 0; e < 4; ++e) {
            const uint32_t q = pos[(l >> 2) + 8 * (e >> 1)], k = key_tile + 8 * nt + 2 * (l & 3) + (e & 1);
            ASSERT_EQ((x[l] >> fd::fwd_bit(nt, e)) & 1, sim.keep(head, q, k) ? 1u : 0u) << "fwd lane " << l;
            ++checked;
          }
      for (int l = 0; l < 32; ++l) {
        const int c = 8 * (l >> 2) + 2 * (l & 3);
        x[l] = fd::bwd_lane_bits_at(draw, sim.threshold, head, pos[c], pos[c + 1], key_tile + 16);
      }
      simulate_exchange<2>(x, 2, [](int l) { return l >> 2; });
      for (int l = 0; l < 32; ++l)
        for (int nt = 0; nt < 8; ++nt)
          for (int e = 0; e < 4; ++e) {
            const uint32_t k = key_tile + 16 + (l >> 2) + 8 * (e >> 1), q = pos[8 * nt + 2 * (l & 3) + (e & 1)];
            ASSERT_EQ((x[l] >> fd::bwd_bit(nt, e)) & 1, sim.keep(head, q, k) ? 1u : 0u) << "bwd lane " << l;
            ++checked;
          }
    }
  EXPECT_EQ(checked, 2 * 2 * 2 * 32 * 32);
}

}  // namespace
}  // namespace nopad
