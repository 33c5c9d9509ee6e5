// Dropout keep bits of the FMHA tiles (fmha_forward.cu, fmha_backward.cu): which Philox blocks each lane draws, how it
// packs their keep bits, and the in-register lane exchange that gives every lane the bits of its own accumulator
// elements. Plain C++ usable on host and device (NOPAD_HOST_DEVICE): tests/test_philox.cpp runs these same functions
// over 32 simulated lanes and checks every bit against the CPU twin's mask (core/philox.h), so the exchange logic is
// verified without a GPU. Design notes: docs/fmha.md, "Dropout".
//
// Contract (core/philox.h, 8-bit attention draws): element_attention(head, q, key) >> 4 is the Philox block, i.e. one
// block covers 16 consecutive keys 16a .. 16a+15 of one query; key 16a + f takes 8-bit field f (word f >> 2, byte
// f & 3).
//
// mma.sync m16n8k16 accumulator layout (g = lane / 4, t = lane % 4): element e of an 8-column n-tile is at row
// g + 8 (e >> 1), column 2t + (e & 1). A lane draws 2 blocks per tile and packs each block's 16 keep bits into one
// 16-bit half of its word, grouped by the lane that needs them (a slot per destination lane); a butterfly transpose
// of those slots inside each half then delivers every lane its own bits.
//   Forward  (rows = queries, columns = keys; 64-key tiles): one block = one row's 16 keys = n-tiles 2j, 2j+1, held by
//            the 4 lanes of a quad (lane s needs fields 2s, 2s+1, 8+2s, 9+2s). Lane t draws the blocks of rows g and
//            g+8 for j = t; 4-bit slots, 2 shuffles: bit fwd_bit(nt, e).
//   Backward (rows = keys, columns = queries; 16 keys per warp): one block = the warp's 16 keys of one query, held by
//            the 8 lanes with the same t (lane g needs fields g and g+8). Lane (g, t) draws the blocks of queries
//            8g + 2t + {0, 1} of the 64-query tile; 2-bit slots, 3 shuffles: bit bwd_bit(nt, e).
// Every block is drawn exactly once per warp, i.e. one Philox block per 16 mask elements.
#pragma once
#include <cstdint>

#include "core/philox.h"

#if defined(__CUDACC__)
#define NOPAD_FMHA_UNROLL _Pragma("unroll")
#else
#define NOPAD_FMHA_UNROLL
#endif

namespace nopad::cuda::fmha_dropout {

// Low and high words of the block index element_attention(head, q, key16) >> 4 for key16 % 16 == 0 and q, key16 <
// 2^20: (head << 36) | (q << 16) | (key16 >> 4). key16 >> 4 < 2^16, so stepping the key never carries into the high
// word.
NOPAD_HOST_DEVICE inline uint32_t block_lo(uint32_t q, uint32_t key16) { return (q << 16) | (key16 >> 4); }
NOPAD_HOST_DEVICE inline uint32_t block_hi(uint32_t head, uint32_t q) { return (head << 4) | (q >> 16); }

// Bits per slot group: each block's 16 keep bits fill one 16-bit half of the lane's word.
constexpr int kGroupBits = 16;

// ------------------------------------------------------------------------------------------------ keep bits
// Keep bits are shifted into an accumulator, acc = 2 acc + keep, one field at a time: field >= threshold exactly when
// field + (256 - threshold) carries out of 8 bits, so with c8 = (256 - threshold) << 24 the keep bit of byte b of v is
// the carry of (v << (24 - 8 b)) + c8 (the bytes below b are shifted along but cannot carry: c8's low 24 bits are 0).
// On the device: add.cc + addc (2 instructions per field; the shift folds into a LEA with carry-out). threshold must
// be in [1, 255] (c8 fits in 32 bits).
NOPAD_HOST_DEVICE inline uint32_t keep_c8(uint32_t threshold) { return (256u - threshold) << 24; }
NOPAD_HOST_DEVICE inline uint32_t push_keep(uint32_t acc, uint32_t v, uint32_t c8) {
#if defined(__CUDA_ARCH__)
  asm("{\n\t.reg .u32 t;\n\tadd.cc.u32 t, %1, %2;\n\taddc.u32 %0, %0, %0;\n\t}" : "+r"(acc) : "r"(v), "r"(c8));
  return acc;
#else
  return 2u * acc + static_cast<uint32_t>((static_cast<uint64_t>(v) + c8) >> 32);
#endif
}
// The keep bit of field f of a block pushed into acc.
NOPAD_HOST_DEVICE inline uint32_t push_field(uint32_t acc, const Philox4x32& b, int f, uint32_t c8) {
  return push_keep(acc, b.v[f >> 2] << (24 - 8 * (f & 3)), c8);
}

// ------------------------------------------------------------------------------------------------ forward
// Lane t's blocks: rr = 0, 1 is row g + 8 rr, keys key_tile + 16 t .. + 15 (n-tiles 2t, 2t + 1). Block rr fills half
// rr, slot s (4 bits, for quad lane s) holds fields 8 c + 2 s + h at bit 4 s + 2 c + h. After the exchange, lane t
// holds at bit 16 rr + 4 s + 2 c + h the bit of source lane s's block rr, field 8 c + 2 t + h: row g + 8 rr, key
// key_tile + 16 s + 8 c + 2 t + h, i.e. accumulator element e = 2 rr + h of n-tile nt = 2 s + c.
NOPAD_HOST_DEVICE constexpr int fwd_bit(int nt, int e) {
  return 16 * (e >> 1) + 4 * (nt >> 1) + 2 * (nt & 1) + (e & 1);
}

// The wgmma forward loads each 64-key K/V tile with its rows permuted: shared-memory row (= S column) c holds key
// key_tile + fwd_key_perm(c). Lane t's S columns 8 nt + 2 t + h then hold keys key_tile + 16 t + 2 nt + h: exactly the
// 16 keys of the lane's own blocks (fwd_lane_bits_at's), field 2 nt + h (word nt >> 1, byte 2 (nt & 1) + h), so that
// kernel needs no lane exchange. Its keep decisions for the packed P fragment of n-tile nt, rows g / g + 8, are the
// two bytes 2 (nt & 1), + 1 of word nt >> 1 of the block of row g / g + 8 (fwd_own_field).
NOPAD_HOST_DEVICE constexpr int fwd_key_perm(int c) { return 16 * ((c >> 1) & 3) + 2 * (c >> 3) + (c & 1); }
// fwd_key_perm(8 nt + 2 t + (e & 1)) for lane t < 4: the key (within the tile) of accumulator element e of n-tile nt.
NOPAD_HOST_DEVICE constexpr int fwd_permuted_key(int nt, int t, int e) { return 16 * t + 2 * nt + (e & 1); }
NOPAD_HOST_DEVICE constexpr int fwd_own_field(int nt, int e) { return 2 * nt + (e & 1); }

// Lane t's block of row position pos: keys key_tile + 16 t .. + 15 (rows g and g + 8 take one each).
template <class Draw>
NOPAD_HOST_DEVICE inline Philox4x32 fwd_lane_block(Draw&& draw, uint32_t head, uint32_t pos, uint32_t key_tile,
                                                   uint32_t t) {
  return draw(block_lo(pos, key_tile + 16u * t), block_hi(head, pos));
}

// pos_g and pos_g8: the query positions (within the sequence: the dropout key) of the lane's rows g and g + 8. They are
// the rows' own indices when every row of the sequence is a query (fwd_lane_bits), any positions when the queries are
// a subset of the rows (FmhaParams::q_positions).
template <class Draw>
NOPAD_HOST_DEVICE inline uint32_t fwd_lane_bits_at(Draw&& draw, uint32_t threshold, uint32_t head, uint32_t pos_g,
                                                   uint32_t pos_g8, uint32_t key_tile, uint32_t t) {
  const uint32_t c8 = keep_c8(threshold);
  uint32_t x = 0;
  NOPAD_FMHA_UNROLL
  for (int rr = 1; rr >= 0; --rr) {
    const Philox4x32 b = fwd_lane_block(draw, head, rr ? pos_g8 : pos_g, key_tile, t);
    NOPAD_FMHA_UNROLL
    for (int f = 15; f >= 0; --f) {  // bit position p = 4 s + 2 c + h, descending: field 8 c + 2 s + h
      const int s = f >> 2, c = (f >> 1) & 1, h = f & 1;
      x = push_field(x, b, 8 * c + 2 * s + h, c8);
    }
  }
  return x;
}
template <class Draw>
NOPAD_HOST_DEVICE inline uint32_t fwd_lane_bits(Draw&& draw, uint32_t threshold, uint32_t head, uint32_t row_g,
                                                uint32_t key_tile, uint32_t t) {
  return fwd_lane_bits_at(draw, threshold, head, row_g, row_g + 8u, key_tile, t);
}

// ------------------------------------------------------------------------------------------------ backward
// Lane (g, t)'s blocks: j = 0, 1 is query q_tile + 8 g + 2 t + j, keys key16 .. key16 + 15 (key16 = the warp's first
// key, a multiple of 16). Block j fills half j, slot s (2 bits, for lane s of the 8 with this t) holds fields s and
// s + 8 at bits 2 s and 2 s + 1. After the exchange, lane g holds at bit 16 j + 2 s + kk the bit of source lane s's
// block j, field g + 8 kk: key key16 + g + 8 kk, query q_tile + 8 s + 2 t + j, i.e. accumulator element e = 2 kk + j
// of n-tile s.
NOPAD_HOST_DEVICE constexpr int bwd_bit(int nt, int e) { return 16 * (e & 1) + 2 * nt + (e >> 1); }

// pos_0 and pos_1: the positions (the dropout key) of the lane's queries q_tile + 8 g + 2 t + {0, 1}; their indices
// when every row is a query (bwd_lane_bits), FmhaParams::q_positions' values when the queries are a subset.
template <class Draw>
NOPAD_HOST_DEVICE inline uint32_t bwd_lane_bits_at(Draw&& draw, uint32_t threshold, uint32_t head, uint32_t pos_0,
                                                   uint32_t pos_1, uint32_t key16) {
  const uint32_t c8 = keep_c8(threshold);
  uint32_t x = 0;
  NOPAD_FMHA_UNROLL
  for (int j = 1; j >= 0; --j) {
    const uint32_t q = j ? pos_1 : pos_0;
    const Philox4x32 b = draw(block_lo(q, key16), block_hi(head, q));
    NOPAD_FMHA_UNROLL
    for (int f = 15; f >= 0; --f) {  // bit position p = 2 s + kk, descending: field s + 8 kk
      const int s = f >> 1, kk = f & 1;
      x = push_field(x, b, s + 8 * kk, c8);
    }
  }
  return x;
}
template <class Draw>
NOPAD_HOST_DEVICE inline uint32_t bwd_lane_bits(Draw&& draw, uint32_t threshold, uint32_t head, uint32_t q_tile,
                                                uint32_t key16, uint32_t g, uint32_t t) {
  const uint32_t q = q_tile + 8u * g + 2u * t;
  return bwd_lane_bits_at(draw, threshold, head, q, q + 1u, key16);
}

// ------------------------------------------------------------------------------------------------ exchange
// Butterfly transpose, group by group: each 16-bit group (kGroupBits) of a lane's word holds n = 16 / kSlotBits slots
// of kSlotBits bits, slot s destined for lane s of a group of n lanes (index i); afterwards lane i's slot s holds what
// lane s's slot i held. Stage b pairs lanes i and i ^ 2^b: the lane sends its slots with index bit b != its own bit b,
// moved to the partner's matching slot (index ^ 2^b) by a shift that stays inside the group, and keeps its other
// slots. Invariant after the stages in S: slot s of lane i holds the item from lane (i on bits not in S, s on S) for
// lane (s on bits not in S, i on S).
template <int kSlotBits>
NOPAD_HOST_DEVICE constexpr uint32_t slot_mask(int b) {  // the bits of the slots whose index has bit b set
  uint32_t m = 0;
  for (int bit = 0; bit < 32; ++bit)
    if ((((bit % kGroupBits) / kSlotBits) >> b) & 1) m |= 1u << bit;
  return m;
}
// What lane i sends at stage b: shifted up by the slot distance if its bit b is set (its bit-clear slots move to the
// partner's matching bit-set slots), down otherwise; what crosses a group boundary lands in slots the partner
// discards. (A per-lane rotate would do as well, but ptxas 13.0 fails register allocation on it in the big kernels.)
template <int kSlotBits>
NOPAD_HOST_DEVICE inline uint32_t xchg_send(uint32_t x, uint32_t i, int b) {
  const uint32_t sh = static_cast<uint32_t>(kSlotBits << b);
  return ((i >> b) & 1u) ? x << sh : x >> sh;
}
// Lane i's word after stage b, y = the partner's xchg_send: own slots with bit b == i's bit b, the partner's others.
template <int kSlotBits>
NOPAD_HOST_DEVICE inline uint32_t xchg_merge(uint32_t x, uint32_t y, uint32_t i, int b) {
  const uint32_t m = slot_mask<kSlotBits>(b);
  const uint32_t k = ((i >> b) & 1u) ? m : ~m;
  return (x & k) | (y & ~k);
}
// Stages of the transpose: log2 of the slots per group.
template <int kSlotBits>
NOPAD_HOST_DEVICE constexpr int xchg_stages() {
  int n = 0;
  while ((1 << n) < kGroupBits / kSlotBits) ++n;
  return n;
}

}  // namespace nopad::cuda::fmha_dropout
