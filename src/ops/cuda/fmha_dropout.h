// Dropout keep bits of the FMHA tiles (fmha_forward.cu, fmha_backward.cu): which Philox blocks each lane draws, how it
// packs their keep bits, and the in-register lane exchange that gives every lane the bits of its own accumulator
// elements. Plain C++ usable on host and device (NOPAD_HOST_DEVICE): tests/test_philox.cpp runs these same functions
// over 32 simulated lanes and checks every bit against the CPU twin's mask (core/philox.h), so the exchange logic is
// verified without a GPU. Design notes: docs/fmha.md, "Dropout".
//
// Contract (core/philox.h): element_attention(head, q, key) >> 3 is the Philox block, i.e. one block covers 8
// consecutive keys 8a .. 8a+7 of one query; key 8a + f takes 16-bit field f (word f >> 1, half f & 1).
//
// mma.sync m16n8k16 accumulator layout (g = lane / 4, t = lane % 4): element e of an 8-column n-tile is at row
// g + 8 (e >> 1), column 2t + (e & 1).
//   Forward  (rows = queries, columns = keys): one block = one row's 8 keys of one n-tile = the 4 lanes of a quad
//            (lane t needs word t). Lane t draws the blocks of (row g and g+8) x (n-tiles t and t+4) of a 64-key tile,
//            one per byte of its word, and a transpose of 2-bit slots (word w -> lane w) inside each byte over the
//            quad (2 shuffles) delivers them: bit fwd_bit(nt, e).
//   Backward (rows = keys, columns = queries): one block = 8 keys (rows g = 0..7 or 8..15 of the warp's 16) of one
//            query = 8 lanes with the same t (lane bits 2-4), lane g needs field g. Lane g draws the blocks of n-tile g
//            (queries 8g + 2t + {0, 1}) x (keys 0..7 and 8..15), one per byte, and a transpose of 1-bit slots (field f
//            -> lane f) inside each byte over those lanes (3 shuffles) delivers them: bit bwd_bit(nt, e).
// Every block is drawn exactly once per warp, i.e. one Philox block per 8 mask elements.
#pragma once
#include <cstdint>

#include "core/philox.h"

#if defined(__CUDACC__)
#define NOPAD_FMHA_UNROLL _Pragma("unroll")
#else
#define NOPAD_FMHA_UNROLL
#endif

namespace nopad::cuda::fmha_dropout {

// Low and high words of the block index element_attention(head, q, key8) >> 3 for key8 % 8 == 0 and q, key8 < 2^20:
// (head << 37) | (q << 17) | (key8 >> 3). key8 >> 3 < 2^17, so stepping the key never carries into the high word.
NOPAD_HOST_DEVICE inline uint32_t block_lo(uint32_t q, uint32_t key8) { return (q << 17) | (key8 >> 3); }
NOPAD_HOST_DEVICE inline uint32_t block_hi(uint32_t head, uint32_t q) { return (head << 5) | (q >> 15); }

// ------------------------------------------------------------------------------------------------ keep bits
// Keep bits are shifted into an accumulator, acc = 2 acc + keep, one field at a time: field >= threshold exactly when
// field + (65536 - threshold) carries out of 16 bits, so with c16 = (65536 - threshold) << 16 the keep bit of the high
// field of v is the carry of v + c16 (the low field cannot carry: c16's low half is 0), and that of the low field the
// carry of (v << 16) + c16. On the device: add.cc + addc (2 instructions per field; the shift of the low field folds
// into a LEA with carry-out). threshold must be in [1, 65535] (c16 fits in 32 bits).
NOPAD_HOST_DEVICE inline uint32_t keep_c16(uint32_t threshold) { return (65536u - threshold) << 16; }
NOPAD_HOST_DEVICE inline uint32_t push_keep_hi(uint32_t acc, uint32_t v, uint32_t c16) {
#if defined(__CUDA_ARCH__)
  asm("{\n\t.reg .u32 t;\n\tadd.cc.u32 t, %1, %2;\n\taddc.u32 %0, %0, %0;\n\t}" : "+r"(acc) : "r"(v), "r"(c16));
  return acc;
#else
  return 2u * acc + static_cast<uint32_t>((static_cast<uint64_t>(v) + c16) >> 32);
#endif
}
NOPAD_HOST_DEVICE inline uint32_t push_keep_lo(uint32_t acc, uint32_t v, uint32_t c16) {
  return push_keep_hi(acc, v << 16, c16);
}
// The 8 keep bits of one Philox block pushed in descending field order (7 = word 3 high .. 0 = word 0 low), so that
// pushed into a zero byte, field f lands at bit f.
NOPAD_HOST_DEVICE inline uint32_t push_block(uint32_t acc, const Philox4x32& b, uint32_t c16) {
  NOPAD_FMHA_UNROLL
  for (int w = 3; w >= 0; --w) {
    acc = push_keep_hi(acc, b.v[w], c16);
    acc = push_keep_lo(acc, b.v[w], c16);
  }
  return acc;
}

// A lane draws 4 blocks and pushes them in the order beta = 3, 2, 1, 0: block beta fills byte beta, field f at bit
// 8 beta + f. Field f is destined for lane f >> 1 (forward: 2-bit slots, word w -> lane w) or lane f (backward: 1-bit
// slots). Each byte is then transposed across the lanes independently (see the exchange below).

// ------------------------------------------------------------------------------------------------ forward
// Lane t's blocks: beta = rr + 2 hh is (row g + 8 rr, n-tile t + 4 hh) of the 64-key tile at key_tile. After the
// exchange, lane t holds at bit 8 beta + 2 s + h the bit of source lane s's block beta, word t, half h: row g + 8 rr,
// key 8 (s + 4 hh) + 2t + h, i.e. accumulator element e = 2 rr + h of n-tile nt = s + 4 hh.
NOPAD_HOST_DEVICE constexpr int fwd_bit(int nt, int e) {
  return 8 * ((e >> 1) + 2 * (nt >> 2)) + 2 * (nt & 3) + (e & 1);
}

// pos_g and pos_g8: the query positions (within the sequence: the dropout key) of the lane's rows g and g + 8. They are
// the rows' own indices when every row of the sequence is a query (fwd_lane_bits), any positions when the queries are
// a subset of the rows (FmhaParams::q_positions).
template <class Draw>
NOPAD_HOST_DEVICE inline uint32_t fwd_lane_bits_at(Draw&& draw, uint32_t threshold, uint32_t head, uint32_t pos_g,
                                                   uint32_t pos_g8, uint32_t key_tile, uint32_t t) {
  const uint32_t c16 = keep_c16(threshold);
  uint32_t x = 0;
  NOPAD_FMHA_UNROLL
  for (int beta = 3; beta >= 0; --beta) {
    const uint32_t row = (beta & 1) ? pos_g8 : pos_g, nt = t + 4u * (beta >> 1);
    x = push_block(x, draw(block_lo(row, key_tile + 8u * nt), block_hi(head, row)), c16);
  }
  return x;
}
template <class Draw>
NOPAD_HOST_DEVICE inline uint32_t fwd_lane_bits(Draw&& draw, uint32_t threshold, uint32_t head, uint32_t row_g,
                                                uint32_t key_tile, uint32_t t) {
  return fwd_lane_bits_at(draw, threshold, head, row_g, row_g + 8u, key_tile, t);
}

// ------------------------------------------------------------------------------------------------ backward
// Lane (g, t)'s blocks: beta = j + 2 kg is (query q_tile + 8 g + 2 t + j, keys key16 + 8 kg .. +7), key16 = the warp's
// first key (a multiple of 16). After the exchange, lane g holds at bit 8 beta + s the bit of source lane s's block
// beta, field g: key key16 + 8 kg + g, query q_tile + 8 s + 2 t + j, i.e. accumulator element e = beta of n-tile s.
NOPAD_HOST_DEVICE constexpr int bwd_bit(int nt, int e) { return 8 * e + nt; }

// pos_0 and pos_1: the positions (the dropout key) of the lane's queries q_tile + 8 g + 2 t + {0, 1}; their indices
// when every row is a query (bwd_lane_bits), FmhaParams::q_positions' values when the queries are a subset.
template <class Draw>
NOPAD_HOST_DEVICE inline uint32_t bwd_lane_bits_at(Draw&& draw, uint32_t threshold, uint32_t head, uint32_t pos_0,
                                                   uint32_t pos_1, uint32_t key16) {
  const uint32_t c16 = keep_c16(threshold);
  uint32_t x = 0;
  NOPAD_FMHA_UNROLL
  for (int beta = 3; beta >= 0; --beta) {
    const uint32_t q = (beta & 1) ? pos_1 : pos_0, key8 = key16 + 8u * (beta >> 1);
    x = push_block(x, draw(block_lo(q, key8), block_hi(head, q)), c16);
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
// Butterfly transpose, byte by byte: each byte of a lane's word holds n = 8 / kSlotBits slots of kSlotBits bits, slot s
// destined for lane s of a group of n lanes (index i); afterwards lane i's slot s holds what lane s's slot i held.
// Stage b pairs lanes i and i ^ 2^b: the lane sends its slots with index bit b != its own bit b, moved to the
// partner's matching slot (index ^ 2^b) by a shift that stays inside the byte, and keeps its other slots. Invariant
// after the stages in S: slot s of lane i holds the item from lane (i on bits not in S, s on S) for lane (s on bits
// not in S, i on S).
template <int kSlotBits>
NOPAD_HOST_DEVICE constexpr uint32_t slot_mask(int b) {  // the bits of the slots whose index has bit b set
  uint32_t m = 0;
  for (int bit = 0; bit < 32; ++bit)
    if ((((bit & 7) / kSlotBits) >> b) & 1) m |= 1u << bit;
  return m;
}
// What lane i sends at stage b: shifted up by the slot distance if its bit b is set (its bit-clear slots move to the
// partner's matching bit-set slots), down otherwise; what crosses a byte boundary lands in slots the partner
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

}  // namespace nopad::cuda::fmha_dropout
