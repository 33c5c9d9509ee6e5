// Philox-4x32-10 counter-based random numbers (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11)
// and the dropout masks built on it. Header-only and usable from CUDA kernels (NOPAD_HOST_DEVICE), so the CPU
// reference and the GPU kernels draw bit-identical masks.
//
// Dropout keying contract (docs/ops.md): a mask bit is a pure function of
//   (seed, step, op_id, sample_id, element)
// where sample_id is the sequence's global identity (HostBatch::sample_ids[b]) and element is built from the position
// *within the sequence* and feature/head indices (see element_hidden / element_attention), never from the row index in
// this process's batch. So the same sample gets the same mask whatever batch, rank or order it is in.
#pragma once
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
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}
}  // namespace philox_detail

// One Philox-4x32 block with `rounds` rounds (10 is the standard, crush-resistant choice).
NOPAD_HOST_DEVICE inline Philox4x32 philox4x32(const uint32_t counter[4], const uint32_t key[2], int rounds = 10) {
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

// 32 random bits for (stream key, sample_id, element). One Philox block serves 4 consecutive elements
// (counter = element / 4 and the sample id; lane = element % 4), so a kernel walking elements in order pays one
// block per 4 draws.
NOPAD_HOST_DEVICE inline uint32_t dropout_bits(uint64_t stream_key, uint64_t sample_id, uint64_t element) {
  const uint64_t block = element >> 2;
  const uint32_t counter[4] = {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                               static_cast<uint32_t>(sample_id), static_cast<uint32_t>(sample_id >> 32)};
  const uint32_t key[2] = {static_cast<uint32_t>(stream_key), static_cast<uint32_t>(stream_key >> 32)};
  return philox4x32(counter, key).v[element & 3];
}

// Uniform float in [0, 1) from the top 24 bits (exactly representable in float).
NOPAD_HOST_DEVICE inline float uniform_from_bits(uint32_t bits) {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}
NOPAD_HOST_DEVICE inline float dropout_uniform(uint64_t seed, uint64_t step, uint32_t op_id, uint64_t sample_id,
                                               uint64_t element) {
  return uniform_from_bits(dropout_bits(dropout_stream_key(seed, step, op_id), sample_id, element));
}
// Keep with probability 1 - p (p = drop probability). p <= 0 keeps everything without drawing.
NOPAD_HOST_DEVICE inline bool dropout_keep(uint64_t seed, uint64_t step, uint32_t op_id, uint64_t sample_id,
                                           uint64_t element, float p) {
  return p <= 0.0f || dropout_uniform(seed, step, op_id, sample_id, element) >= p;
}
// Same, with the stream key already mixed (what inner loops use).
NOPAD_HOST_DEVICE inline bool dropout_keep_key(uint64_t stream_key, uint64_t sample_id, uint64_t element, float p) {
  return p <= 0.0f || uniform_from_bits(dropout_bits(stream_key, sample_id, element)) >= p;
}

}  // namespace nopad
