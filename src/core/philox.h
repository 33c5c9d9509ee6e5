// Philox-4x32 counter-based random numbers (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11)
// and the dropout masks built on it: 10 rounds for the hidden-state dropouts, 7 for the attention-probability masks.
// Header-only and usable from CUDA kernels (NOPAD_HOST_DEVICE), so the CPU reference and the GPU kernels draw
// bit-identical masks.
//
// Dropout keying contract (docs/ops.md): a mask bit is a pure function of
//   (seed, step, op_id, sample_id, element)
// where sample_id is the sequence's global identity (HostBatch::sample_ids[b]) and element is built from the position
// *within the sequence* and feature/head indices (see element_hidden / element_attention), never from the row index in
// this process's batch. So the same sample gets the same mask whatever batch, rank or order it is in.
//
// Hidden-state dropouts draw 16 bits per element: one Philox block (counter = (element >> 3, sample_id), key = the
// stream key) gives 8 sixteen-bit values; element e takes word (e & 7) >> 1, low half for even e, high half for odd e.
// An element is kept iff its value >= threshold = ceil(p * 65536), and kept values are scaled by
// 65536 / (65536 - threshold) (rounded to float once), so E[mask * scale] = 1 for the exact quotient. p = 0 draws
// nothing and keeps everything; p > 1 - 2^-16 (threshold 65536: nothing kept) is rejected by the callers
// (dropout_p_supported).
//
// The attention-probability masks draw 8 bits per element (the attention_dropout_* functions): one block gives 16
// eight-bit values, element e takes byte (e & 3) of word (e & 15) >> 2, kept iff its value >= ceil(p * 256), kept
// values scaled by 256 / (256 - threshold). So the attention's p is rounded up to a multiple of 1/256 (0.1 runs as
// 26/256 = 0.1015625), and the scale is that of the rounded rate, so the mask stays unbiased (E[mask * scale] = 1).
// Why: these masks cover the L^2 scores and are drawn twice (forward and backward); half the Philox blocks took the
// FMHA forward at p = 0.1 from 0.441 to 0.395 ms and the BERT-large step from 209.1 to 206.4 ms on an H100
// (docs/performance.md, "8-bit attention dropout draws"). FlashAttention-2's dropout quantises p to 8 bits as well.
//
// Rounds: the hidden-state dropouts (memory-bound kernels, where the draws hide under the memory traffic) use the
// standard 10 rounds. The attention-probability masks use 7 (kAttentionPhiloxRounds): there the draws are the FMHA
// kernels' largest block of integer work (one block per 8 of the L^2 scores, in the forward and again in the
// backward), and Philox-4x32-7 already passes TestU01's BigCrush (the paper's table of Crush-resistant round counts);
// FlashAttention-2's dropout uses 7 rounds as well. Every function below takes the round count; the attention callers
// pass kAttentionPhiloxRounds.
#pragma once
#include <math.h>

#include <cstdint>

#if defined(__CUDACC__)
#define NOPAD_HOST_DEVICE __host__ __device__
#else
#define NOPAD_HOST_DEVICE
#endif

namespace nopad {

struct Philox4x32 {
  uint32_t v[4];
};

namespace philox_detail {
constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;    // round multipliers
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments (golden ratio, sqrt(3)-1)

NOPAD_HOST_DEVICE inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  // One 32 x 32 -> 64-bit multiply whose halves are a register pair: the portable form below reaches the device
  // code as 64-bit arithmetic and costs an extra add per multiply there.
  uint64_t p;
  asm("mul.wide.u32 %0, %1, %2;" : "=l"(p) : "r"(a), "r"(b));
  asm("mov.b64 {%0, %1}, %2;" : "=r"(lo), "=r"(hi) : "l"(p));
#else
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
#endif
}
}  // namespace philox_detail

constexpr int kPhiloxRounds = 10;          // the standard choice: the hidden-state dropouts
constexpr int kAttentionPhiloxRounds = 7;  // the attention-probability masks (see above)

// One Philox-4x32 block with `rounds` rounds.
NOPAD_HOST_DEVICE inline Philox4x32 philox4x32(const uint32_t counter[4], const uint32_t key[2],
                                               int rounds = kPhiloxRounds) {
  using namespace philox_detail;
  uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int r = 0; r < rounds; ++r) {
    if (r > 0) {  // the key is bumped between rounds, not before the first
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, c0, hi0, lo0);
    mulhilo(kMul1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

// Mixes (seed, step, op_id) into the 64-bit Philox key (SplitMix64 finaliser: adjacent steps/ops give unrelated keys).
NOPAD_HOST_DEVICE inline uint64_t philox_mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
NOPAD_HOST_DEVICE inline uint64_t dropout_stream_key(uint64_t seed, uint64_t step, uint32_t op_id) {
  return philox_mix64(philox_mix64(philox_mix64(seed) ^ step) ^ op_id);
}

// Element keys: position within the sequence (< 2^20 for attention) and feature/head indices.
NOPAD_HOST_DEVICE inline uint64_t element_hidden(uint32_t pos_in_seq, uint32_t feature) {
  return (static_cast<uint64_t>(pos_in_seq) << 32) | feature;
}
NOPAD_HOST_DEVICE inline uint64_t element_attention(uint32_t head, uint32_t query_pos, uint32_t key_pos) {
  return (static_cast<uint64_t>(head) << 40) | (static_cast<uint64_t>(query_pos) << 20) | key_pos;
}

namespace philox_detail {
// ceil(p * kRange) for p > 0 (exact: p * kRange is exact in float for kRange a power of two), 0 for p <= 0.
template <uint32_t kRange>
NOPAD_HOST_DEVICE inline uint32_t threshold(float p) {
  return p > 0.0f ? static_cast<uint32_t>(ceilf(p * static_cast<float>(kRange))) : 0u;
}
// kRange / (kRange - threshold) for draws in [0, kRange), kRange a power of two, rounded to float once. The host
// computes the quotient in double and rounds it; the device computes the correctly rounded float reciprocal of the
// (exact) integer divisor times kRange, which is the same float for every threshold (double rounding through double
// is innocuous for a division: 53 >= 2 * 24 + 2 bits).
template <uint32_t kRange>
NOPAD_HOST_DEVICE inline float keep_scale(uint32_t threshold) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(static_cast<float>(kRange - threshold)) * static_cast<float>(kRange);
#else
  return static_cast<float>(static_cast<double>(kRange) / static_cast<double>(kRange - threshold));
#endif
}
// (kRange - threshold) / kRange, exact in float: the kept fraction.
template <uint32_t kRange>
NOPAD_HOST_DEVICE inline float keep_fraction(uint32_t threshold) {
  return static_cast<float>(kRange - threshold) / static_cast<float>(kRange);
}
}  // namespace philox_detail

// ------------------------------------------------------------------------------------------------ 16-bit draws
constexpr uint32_t kDropoutRange = 65536;               // the draws are 16-bit values in [0, 65536)
constexpr float kDropoutMaxP = 1.0f - 1.0f / 65536.0f;  // largest p that keeps something (threshold 65535)

// Philox block index of an element: one block serves the 8 elements with the same element >> 3.
NOPAD_HOST_DEVICE inline uint64_t dropout_block_index(uint64_t element) { return element >> 3; }

// The Philox block (8 sixteen-bit draws) of block index `block` of sample `sample_id` in stream `stream_key`.
NOPAD_HOST_DEVICE inline Philox4x32 dropout_philox(uint64_t stream_key, uint64_t sample_id, uint64_t block,
                                                   int rounds) {
  const uint32_t counter[4] = {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                               static_cast<uint32_t>(sample_id), static_cast<uint32_t>(sample_id >> 32)};
  const uint32_t key[2] = {static_cast<uint32_t>(stream_key), static_cast<uint32_t>(stream_key >> 32)};
  return philox4x32(counter, key, rounds);
}

// The 16-bit draw of element e (only e & 7 matters) from its block: word (e & 7) >> 1, low half for even e.
NOPAD_HOST_DEVICE inline uint32_t dropout_field(const Philox4x32& block, uint32_t e) {
  return (block.v[(e & 7u) >> 1] >> (16u * (e & 1u))) & 0xFFFFu;
}

// 16 random bits for (stream key, sample_id, element).
NOPAD_HOST_DEVICE inline uint32_t dropout_bits16(uint64_t stream_key, uint64_t sample_id, uint64_t element,
                                                 int rounds) {
  return dropout_field(dropout_philox(stream_key, sample_id, dropout_block_index(element), rounds),
                       static_cast<uint32_t>(element));
}

// Keep iff the 16-bit draw >= threshold = ceil(p * 65536); 0 for p <= 0 (keep all). p * 65536 is exact in float, so
// this is the exact ceiling. Returns 65536 for p > 1 - 2^-16, which callers reject (dropout_p_supported).
NOPAD_HOST_DEVICE inline uint32_t dropout_threshold(float p) { return philox_detail::threshold<kDropoutRange>(p); }
// p in [0, 1 - 2^-16]: a probability whose threshold keeps something (NaN fails).
NOPAD_HOST_DEVICE inline bool dropout_p_supported(float p) { return p >= 0.0f && p <= kDropoutMaxP; }

// Keep-scale 65536 / (65536 - threshold), rounded to float once (philox_detail::keep_scale; tests/test_philox.cpp
// checks all 65536 thresholds of the device expression against the host's).
NOPAD_HOST_DEVICE inline float dropout_keep_scale(uint32_t threshold) {
  return philox_detail::keep_scale<kDropoutRange>(threshold);
}

// Its inverse (65536 - threshold) / 65536, exact in float: the kept fraction.
NOPAD_HOST_DEVICE inline float dropout_keep_fraction(uint32_t threshold) {
  return philox_detail::keep_fraction<kDropoutRange>(threshold);
}

// Keep decisions. threshold 0 keeps everything without drawing.
NOPAD_HOST_DEVICE inline bool dropout_keep_threshold(uint64_t stream_key, uint64_t sample_id, uint64_t element,
                                                     uint32_t threshold, int rounds) {
  return threshold == 0 || dropout_bits16(stream_key, sample_id, element, rounds) >= threshold;
}
// Same from p (the stream key already mixed; what inner loops of reference code use).
NOPAD_HOST_DEVICE inline bool dropout_keep_key(uint64_t stream_key, uint64_t sample_id, uint64_t element, float p,
                                               int rounds) {
  return dropout_keep_threshold(stream_key, sample_id, element, dropout_threshold(p), rounds);
}
// Keep with probability (65536 - threshold) / 65536 ~ 1 - p (p = drop probability). p <= 0 keeps everything.
NOPAD_HOST_DEVICE inline bool dropout_keep(uint64_t seed, uint64_t step, uint32_t op_id, uint64_t sample_id,
                                           uint64_t element, float p, int rounds) {
  return p <= 0.0f || dropout_keep_key(dropout_stream_key(seed, step, op_id), sample_id, element, p, rounds);
}

// ------------------------------------------------------------------------------------------------ 8-bit draws
// The attention-probability masks (element_attention elements, kAttentionPhiloxRounds rounds); see the top of the
// file. Callers validate p with attention_dropout_p_supported.
constexpr uint32_t kAttentionDropoutRange = 256;             // the draws are 8-bit values in [0, 256)
constexpr float kAttentionDropoutMaxP = 1.0f - 1.0f / 256.0f;  // largest p that keeps something (threshold 255)

// Philox block index of an attention element: one block serves the 16 elements with the same element >> 4.
NOPAD_HOST_DEVICE inline uint64_t attention_dropout_block_index(uint64_t element) { return element >> 4; }

// The 8-bit draw of element e (only e & 15 matters) from its block: byte (e & 3) of word (e & 15) >> 2.
NOPAD_HOST_DEVICE inline uint32_t attention_dropout_field(const Philox4x32& block, uint32_t e) {
  return (block.v[(e & 15u) >> 2] >> (8u * (e & 3u))) & 0xFFu;
}

// 8 random bits for (stream key, sample_id, attention element).
NOPAD_HOST_DEVICE inline uint32_t attention_dropout_bits8(uint64_t stream_key, uint64_t sample_id, uint64_t element) {
  return attention_dropout_field(
      dropout_philox(stream_key, sample_id, attention_dropout_block_index(element), kAttentionPhiloxRounds),
      static_cast<uint32_t>(element));
}

// Keep iff the 8-bit draw >= threshold = ceil(p * 256); 0 for p <= 0 (keep all). p * 256 is exact in float. Returns
// 256 for p > 1 - 2^-8, which callers reject (attention_dropout_p_supported).
NOPAD_HOST_DEVICE inline uint32_t attention_dropout_threshold(float p) {
  return philox_detail::threshold<kAttentionDropoutRange>(p);
}
// p in [0, 1 - 2^-8] (NaN fails).
NOPAD_HOST_DEVICE inline bool attention_dropout_p_supported(float p) {
  return p >= 0.0f && p <= kAttentionDropoutMaxP;
}
// The drop probability the mask really has: threshold / 256, i.e. p rounded up to a multiple of 1/256.
NOPAD_HOST_DEVICE inline float attention_dropout_effective_p(float p) {
  return static_cast<float>(attention_dropout_threshold(p)) / 256.0f;
}

// Keep-scale 256 / (256 - threshold), rounded to float once (philox_detail::keep_scale; all 256 thresholds checked
// by tests/test_philox.cpp).
NOPAD_HOST_DEVICE inline float attention_dropout_keep_scale(uint32_t threshold) {
  return philox_detail::keep_scale<kAttentionDropoutRange>(threshold);
}
// Its inverse (256 - threshold) / 256, exact in float: the kept fraction.
NOPAD_HOST_DEVICE inline float attention_dropout_keep_fraction(uint32_t threshold) {
  return philox_detail::keep_fraction<kAttentionDropoutRange>(threshold);
}

// Keep decisions. threshold 0 keeps everything without drawing.
NOPAD_HOST_DEVICE inline bool attention_dropout_keep_threshold(uint64_t stream_key, uint64_t sample_id,
                                                               uint64_t element, uint32_t threshold) {
  return threshold == 0 || attention_dropout_bits8(stream_key, sample_id, element) >= threshold;
}
NOPAD_HOST_DEVICE inline bool attention_dropout_keep_key(uint64_t stream_key, uint64_t sample_id, uint64_t element,
                                                         float p) {
  return attention_dropout_keep_threshold(stream_key, sample_id, element, attention_dropout_threshold(p));
}
NOPAD_HOST_DEVICE inline bool attention_dropout_keep(uint64_t seed, uint64_t step, uint32_t op_id, uint64_t sample_id,
                                                     uint64_t element, float p) {
  return p <= 0.0f || attention_dropout_keep_key(dropout_stream_key(seed, step, op_id), sample_id, element, p);
}

}  // namespace nopad
