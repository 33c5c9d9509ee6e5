// The consumer barrier protocol of the `ws128q` FMHA backward (ops/cuda/fmha_wsq_barriers.h), model-checked on the
// CPU: every interleaving of the consumers' barrier operations is explored, and in none may a dS^T barrier's phase
// complete with arrivals other than one full consumer's arrival and the other consumer's wait, all of one tile (a
// consumer arriving twice in one phase completes it early and deadlocks the CTA), nor may the consumers stall. The kernel's own order of
// operations per tile and consumer c is modelled:
//   bar.arrive ds_done_barrier(tile, c), 256      (its dS^T rows of the tile are written)
//   bar.sync   ds_done_barrier(tile, 1 - c), 256  (the other consumer's rows are written)
//   bar.sync   kBarStage + c, 128                  (finish_dq: its own warps' dQ stage written)
// Two models: whole consumers (warpgroups arrive as one; long runs of tiles), and single warps (each of the 8 consumer
// warps arrives on its own, 32 threads at a time, as the hardware counts them; shorter runs). The same checker must
// find the deadlock of the protocol the kernel had before (one barrier per consumer), so it can fail.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_set>
#include <vector>

#include "ops/cuda/fmha_wsq_barriers.h"

namespace nopad {
namespace {

using Protocol = std::function<int(int tile, int consumer)>;

enum class Op { kArrive, kSyncOther, kSyncStage };

// The barrier program of `per_consumer` agents per consumer (1: the warpgroup as one agent, 4: its warps), 3 steps per
// tile. Arrivals are counted in agents: a dS^T barrier (256 threads) completes at 2 per_consumer arrivals, a
// consumer's stage barrier (128 threads) at per_consumer.
struct Model {
  int tiles;
  int per_consumer;  // agents per consumer
  Protocol ds_barrier;
  static constexpr int kStageBase = 1;  // the kernel's kBarStage

  int agents() const { return 2 * per_consumer; }
  int steps() const { return 3 * tiles; }
  Op op(int step) const { return static_cast<Op>(step % 3); }
  int barrier(int agent, int step) const {
    const int c = agent / per_consumer, tile = step / 3;
    switch (op(step)) {
      case Op::kArrive: return ds_barrier(tile, c);
      case Op::kSyncOther: return ds_barrier(tile, 1 - c);
      case Op::kSyncStage: return kStageBase + c;
    }
    return -1;
  }
  int expected(int bar) const { return bar < cuda::fmha_wsq::kBarDsDone ? per_consumer : 2 * per_consumer; }
};

constexpr int kNumBarriers = 16;  // named barrier ids 0..15

struct State {
  std::vector<int> pc;       // next step per agent
  std::vector<int> blocked;  // barrier the agent waits at, -1: none
  std::vector<int> count[2];  // per barrier, arrivals of consumer 0 / 1 in the current phase
  std::vector<int> tile;      // per barrier, the tile of the current phase's arrivals (-1: none yet)

  std::string key() const {
    std::string k;
    for (size_t i = 0; i < pc.size(); ++i) {
      k += static_cast<char>(pc[i]);
      k += static_cast<char>(blocked[i] + 1);
    }
    for (int b = 0; b < kNumBarriers; ++b) {
      k += static_cast<char>(count[0][b]);
      k += static_cast<char>(count[1][b]);
      k += static_cast<char>(tile[b] + 1);
    }
    return k;
  }
};

struct Result {
  bool violation = false;  // a dS^T phase completed with another mix of arrivals, or mixed tiles
  bool deadlock = false;   // no agent can move before all have finished
  std::string what;
  size_t states = 0;
};

// Depth-first over every interleaving (states deduplicated).
Result explore(const Model& m) {
  Result r;
  State s0;
  s0.pc.assign(m.agents(), 0);
  s0.blocked.assign(m.agents(), -1);
  s0.count[0].assign(kNumBarriers, 0);
  s0.count[1].assign(kNumBarriers, 0);
  s0.tile.assign(kNumBarriers, -1);
  std::unordered_set<std::string> seen;
  std::vector<State> stack{s0};
  seen.insert(s0.key());
  while (!stack.empty() && !r.violation && !r.deadlock) {
    const State s = stack.back();
    stack.pop_back();
    bool moved = false, finished = true;
    for (int a = 0; a < m.agents(); ++a) {
      if (s.pc[a] < m.steps()) finished = false;
      if (s.pc[a] >= m.steps() || s.blocked[a] >= 0) continue;
      moved = true;
      State n = s;
      const int step = n.pc[a]++;
      const int bar = m.barrier(a, step), c = a / m.per_consumer, tile = step / 3;
      if (n.tile[bar] >= 0 && n.tile[bar] != tile) {
        r.violation = true;  // a barrier phase pairs the operations of two different tiles
        r.what = "barrier " + std::to_string(bar) + ": an arrival for tile " + std::to_string(tile) +
                 " joined the phase of tile " + std::to_string(n.tile[bar]) + " (agent " + std::to_string(a) + ")";
        break;
      }
      n.tile[bar] = tile;
      ++n.count[c][bar];
      const int total = n.count[0][bar] + n.count[1][bar];
      if (total == m.expected(bar)) {
        // The phase completes: a dS^T barrier needs one consumer's arrival and the other's wait, i.e. every agent of
        // both consumers once.
        if (bar >= cuda::fmha_wsq::kBarDsDone &&
            (n.count[0][bar] != m.per_consumer || n.count[1][bar] != m.per_consumer)) {
          r.violation = true;
          r.what = "barrier " + std::to_string(bar) + " completed with " + std::to_string(n.count[0][bar]) +
                   " arrivals of consumer 0 and " + std::to_string(n.count[1][bar]) + " of consumer 1 (agent " +
                   std::to_string(a) + ", step " + std::to_string(step) + ")";
          break;
        }
        n.count[0][bar] = n.count[1][bar] = 0;
        n.tile[bar] = -1;
        for (int& b : n.blocked)
          if (b == bar) b = -1;
      } else if (m.op(step) != Op::kArrive) {
        n.blocked[a] = bar;  // bar.sync waits for the phase it joined
      }
      if (seen.insert(n.key()).second) stack.push_back(std::move(n));
    }
    if (!moved && !finished && !r.violation) {
      r.deadlock = true;
      r.what = "no agent can move";
    }
  }
  r.states = seen.size();
  return r;
}

int ds_barrier_main(int tile, int consumer) { return cuda::fmha_wsq::ds_done_barrier(tile, consumer); }
int ds_barrier_one_per_consumer(int /*tile*/, int consumer) { return cuda::fmha_wsq::kBarDsDone + consumer; }

TEST(FmhaWsqBarriers, BarrierIdsAreDistinctAndInRange) {
  // The kernel computes ds_done_barrier(tile, 0) once per tile and adds the consumer: the ids must allow that.
  for (int tile = 0; tile < 8; ++tile) {
    for (int c = 0; c < 2; ++c) {
      const int id = cuda::fmha_wsq::ds_done_barrier(tile, c);
      EXPECT_EQ(id, cuda::fmha_wsq::ds_done_barrier(tile, 0) + c);
      EXPECT_GE(id, cuda::fmha_wsq::kBarDsDone);
      EXPECT_LT(id, cuda::fmha_wsq::kBarDsDone + cuda::fmha_wsq::kNumDsDoneBarriers);
      EXPECT_LT(id, kNumBarriers);
      EXPECT_GE(id, Model::kStageBase + 2);  // not a stage barrier
    }
    EXPECT_NE(cuda::fmha_wsq::ds_done_barrier(tile, 0), cuda::fmha_wsq::ds_done_barrier(tile + 1, 0));
    EXPECT_EQ(cuda::fmha_wsq::ds_done_barrier(tile, 1), cuda::fmha_wsq::ds_done_barrier(tile + 2, 1));
  }
}

TEST(FmhaWsqBarriers, WholeConsumersNeverDoubleArriveNorStall) {
  for (int tiles = 1; tiles <= 12; ++tiles) {
    const Result r = explore(Model{tiles, 1, ds_barrier_main});
    EXPECT_FALSE(r.violation) << tiles << " tiles: " << r.what;
    EXPECT_FALSE(r.deadlock) << tiles << " tiles: " << r.what;
    EXPECT_GT(r.states, static_cast<size_t>(3 * tiles));  // more than one order was explored
  }
}

TEST(FmhaWsqBarriers, SingleWarpsNeverDoubleArriveNorStall) {
  for (int tiles = 1; tiles <= 4; ++tiles) {
    const Result r = explore(Model{tiles, 4, ds_barrier_main});
    EXPECT_FALSE(r.violation) << tiles << " tiles: " << r.what;
    EXPECT_FALSE(r.deadlock) << tiles << " tiles: " << r.what;
    // The warps of one consumer drift apart up to a tile: ~12,000 reachable states per tile (7,266 at one tile).
    EXPECT_GT(r.states, static_cast<size_t>(5000 * tiles));
  }
}

// The checker's negative control: one barrier per consumer, the kernel's protocol until 2026-11-28, lets a consumer
// arrive at its barrier for the next tile before the other has waited there.
TEST(FmhaWsqBarriers, OneBarrierPerConsumerDoubleArrives) {
  const Result whole = explore(Model{2, 1, ds_barrier_one_per_consumer});
  EXPECT_TRUE(whole.violation) << "the checker missed the known double arrival";
  const Result warps = explore(Model{2, 4, ds_barrier_one_per_consumer});
  EXPECT_TRUE(warps.violation) << "the checker missed the known double arrival";
}

}  // namespace
}  // namespace nopad
