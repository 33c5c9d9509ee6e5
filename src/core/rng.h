// Deterministic pseudo-random numbers for the data pipeline (instance creation, shuffles). Streams are derived from a
// key (seed, purpose, index...) with SplitMix64, so each document or epoch has its own stream and results do not
// depend on thread scheduling. The generator is xoshiro256** (public-domain algorithm by Blackman and Vigna).
// Dropout randomness lives in core/philox.h instead (it must be reproducible on the GPU).
#pragma once
#include <cstdint>
#include <initializer_list>

namespace nopad {

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Mixes a list of integers into one 64-bit key.
inline uint64_t mix_key(std::initializer_list<uint64_t> parts) {
  uint64_t state = 0x6E6F706164ull;  // "nopad"
  uint64_t h = 0;
  for (uint64_t p : parts) {
    state ^= p + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h = splitmix64(state);
  }
  return h;
}

class Rng {
 public:
  explicit Rng(uint64_t seed) {
    uint64_t s = seed;
    for (auto& x : s_) x = splitmix64(s);
  }
  Rng(std::initializer_list<uint64_t> key) : Rng(mix_key(key)) {}

  uint64_t next_u64() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Uniform double in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Uniform integer in [lo, hi] inclusive (Lemire's nearly-divisionless method; unbiased).
  int64_t uniform_int(int64_t lo, int64_t hi) {
    const uint64_t range = static_cast<uint64_t>(hi - lo) + 1;
    if (range == 0) return static_cast<int64_t>(next_u64());
    __uint128_t m = static_cast<__uint128_t>(next_u64()) * range;
    uint64_t low = static_cast<uint64_t>(m);
    if (low < range) {
      const uint64_t threshold = (0 - range) % range;
      while (low < threshold) {
        m = static_cast<__uint128_t>(next_u64()) * range;
        low = static_cast<uint64_t>(m);
      }
    }
    return lo + static_cast<int64_t>(m >> 64);
  }
  template <class It>
  void shuffle(It first, It last) {
    const int64_t n = last - first;
    for (int64_t i = n - 1; i > 0; --i) {
      const int64_t j = uniform_int(0, i);
      using std::swap;
      swap(first[i], first[j]);
    }
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

}  // namespace nopad
