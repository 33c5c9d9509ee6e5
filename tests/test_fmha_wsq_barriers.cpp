// The synchronisation of the `ws128q` FMHA backward (ops/cuda/fmha_wsq_barriers.h, fmha_backward.cu), model-checked
// on the CPU: every interleaving of the modelled operations is explored.
// 1. The consumers' named barriers. No dS^T barrier phase may complete with arrivals other than one consumer's
//    arrival and the other consumer's wait, all of one tile (a consumer arriving twice in one phase completes it early
//    and deadlocks the CTA), and the consumers may not stall. The kernel's order of operations per tile and consumer c:
//      bar.arrive ds_done_barrier(tile, c), 256      (its dS^T rows of the tile are written)
//      bar.sync   ds_done_barrier(tile, 1 - c), 256  (the other consumer's rows are written)
//      bar.sync   kBarStage + c, 128                  (finish_dq: its own warps' dQ stage written)
//    Modelled with whole consumers (a warpgroup arrives as one; long runs of tiles) and with single warps (each of the
//    8 consumer warps arrives on its own, 32 threads at a time, as the hardware counts them; shorter runs).
// 2. The whole CTA's skeleton (below): producer warps, consumers, the mbarriers with their parity waits, the published
//    item slot and the shared-memory stages and K/V buffers.
// Negative controls (the one-barrier protocol the kernel had before, a stage refilled before its release) show that
// the checkers can fail.
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

  int agents() const { return 2 * per_consumer; }
  int steps() const { return 3 * tiles; }
  Op op(int step) const { return static_cast<Op>(step % 3); }
  int barrier(int agent, int step) const {
    const int c = agent / per_consumer, tile = step / 3;
    switch (op(step)) {
      case Op::kArrive:
        return ds_barrier(tile, c);
      case Op::kSyncOther:
        return ds_barrier(tile, 1 - c);
      case Op::kSyncStage:
        return cuda::fmha_wsq::kBarStage + c;
    }
    return -1;
  }
  int expected(int bar) const { return bar < cuda::fmha_wsq::kBarDsDone ? per_consumer : 2 * per_consumer; }
};

constexpr int kNumBarriers = 16;  // named barrier ids 0..15

// Appends small values (-2 .. 253) to a state key, one byte each.
void put_key(std::string& k, int v) { k += static_cast<char>(v + 2); }

// The named barriers' current phases, shared by both checkers: per barrier, the arrivals of consumer 0 / 1 and the
// tile they belong to (-1: none yet).
struct NamedPhases {
  std::vector<int> count[2] = {std::vector<int>(kNumBarriers, 0), std::vector<int>(kNumBarriers, 0)};
  std::vector<int> tile = std::vector<int>(kNumBarriers, -1);

  void key(std::string& k) const {
    for (int b = 0; b < kNumBarriers; ++b) {
      put_key(k, count[0][b]);
      put_key(k, count[1][b]);
      put_key(k, tile[b]);
    }
  }
  // Agent `agent` of consumer c arrives at `bar` for tile `op_tile` (`sync`: bar.sync, which waits for the phase it
  // joins). `expected` arrivals complete the phase; a dS^T barrier's must be every agent of both consumers once
  // (expected / 2 each). On completion the agents waiting there (blocked) go on; a sync that does not complete it
  // blocks its agent. Returns what went wrong, or "".
  std::string join(int bar, int c, int op_tile, int expected, bool sync, int agent, std::vector<int>& blocked) {
    if (tile[bar] >= 0 && tile[bar] != op_tile)  // a barrier phase pairs the operations of two different tiles
      return "barrier " + std::to_string(bar) + ": an arrival for tile " + std::to_string(op_tile) +
             " joined the phase of tile " + std::to_string(tile[bar]) + " (agent " + std::to_string(agent) + ")";
    tile[bar] = op_tile;
    ++count[c][bar];
    if (count[0][bar] + count[1][bar] == expected) {
      if (bar >= cuda::fmha_wsq::kBarDsDone && (count[0][bar] != expected / 2 || count[1][bar] != expected / 2))
        return "barrier " + std::to_string(bar) + " completed with " + std::to_string(count[0][bar]) +
               " arrivals of consumer 0 and " + std::to_string(count[1][bar]) + " of consumer 1 (agent " +
               std::to_string(agent) + ")";
      count[0][bar] = count[1][bar] = 0;
      tile[bar] = -1;
      for (int& b : blocked)
        if (b == bar) b = -1;
    } else if (sync) {
      blocked[agent] = bar;
    }
    return "";
  }
};

struct State {
  std::vector<int> pc;       // next step per agent
  std::vector<int> blocked;  // barrier the agent waits at, -1: none
  NamedPhases named;

  std::string key() const {
    std::string k;
    for (size_t i = 0; i < pc.size(); ++i) {
      put_key(k, pc[i]);
      put_key(k, blocked[i]);
    }
    named.key(k);
    return k;
  }
};

struct Result {
  bool violation = false;  // a dS^T phase completed with another mix of arrivals, or mixed tiles
  bool deadlock = false;   // no agent can move before all have finished
  std::string what;
  size_t states = 0;
};

// Depth-first over every interleaving from s0 (states deduplicated by key()). move(n, a, r) advances agent a in n and
// returns true, or returns false when a cannot move (finished, or waiting); it records a violation in r. done(s): every
// agent has finished.
template <class S, class Move, class Done>
Result search(const S& s0, int agents, Move move, Done done) {
  Result r;
  std::unordered_set<std::string> seen{s0.key()};
  std::vector<S> stack{s0};
  while (!stack.empty() && !r.violation && !r.deadlock) {
    const S s = stack.back();
    stack.pop_back();
    bool moved = false;
    for (int a = 0; a < agents && !r.violation; ++a) {
      S n = s;
      if (!move(n, a, r)) continue;
      moved = true;
      if (!r.violation && seen.insert(n.key()).second) stack.push_back(std::move(n));
    }
    if (!moved && !done(s) && !r.violation) {
      r.deadlock = true;
      r.what = "no agent can move";
    }
  }
  r.states = seen.size();
  return r;
}

Result explore(const Model& m) {
  State s0;
  s0.pc.assign(m.agents(), 0);
  s0.blocked.assign(m.agents(), -1);
  const auto move = [&](State& n, int a, Result& r) {
    if (n.pc[a] >= m.steps() || n.blocked[a] >= 0) return false;
    const int step = n.pc[a]++;
    const int bar = m.barrier(a, step);
    r.what = n.named.join(bar, a / m.per_consumer, step / 3, m.expected(bar), m.op(step) != Op::kArrive, a, n.blocked);
    r.violation = !r.what.empty();
    return true;
  };
  const auto done = [&](const State& s) {
    for (int pc : s.pc)
      if (pc < m.steps()) return false;
    return true;
  };
  return search(s0, m.agents(), move, done);
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
      EXPECT_GE(id, cuda::fmha_wsq::kBarStage + 2);  // not a stage barrier
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

// ---------------------------------------------------------------------------------------------------------------------
// The whole CTA's synchronisation skeleton: producer warps 0..3 and the two consumers (whole warpgroups) on a
// sequence of work items, with the kernel's mbarriers (item_full, kv_full, kv_empty, full, empty; parity waits), the
// published item slot sItem[2] and the consumers' named barriers. An mbarrier wait is checked against what the kernel
// means by it: a wait for the k-th completion of a barrier (parity k & 1) must pass exactly when at least k + 1 phases
// have completed; with the barrier one phase behind it must not pass, and two or more ahead (an ABA on the parity)
// would stall it. Every read of sItem must see the item of its own iteration.

enum class SkOp { kMArrive, kMWait, kNArrive, kNSync, kWriteItem, kReadItem, kEnd };
struct SkStep {
  SkOp op;
  int bar;        // mbarrier index, named barrier id, or the sItem slot
  int arg;        // arrival units, the completion awaited, the tile of a named barrier operation, or the item
  int data = -1;  // the tile (stages) or item (K/V buffers) whose shared-memory data the step writes or reads
};

// mbarrier indices of the skeleton: item_full[2], kv_full[2], kv_empty[2], full[2], empty[2] (kStages = 2).
constexpr int kItemFull = 0, kKvFull = 2, kKvEmpty = 4, kFull = 6, kEmpty = 8, kNumMbar = 10;
constexpr int kStages = 2;
// Arrivals that complete a phase, in warps: item_full 1 (warp 0's lane 0), kv_full and full 4 (every producer lane:
// 128 threads = 4 warps), kv_empty and empty 8 (lane 0 of every consumer warp).
int mbar_expected(int bar) {
  if (bar < kKvFull) return 1;
  if (bar < kKvEmpty) return 4;
  if (bar < kFull) return 8;
  if (bar < kEmpty) return 4;
  return 8;
}

// Agents 0..3: producer warps (warp 0 also fetches and publishes items); 4, 5: consumers 0 and 1 (4 warps each,
// moving together). tiles_per_item: the query tiles of each item the CTA gets; then the end of the work (item -1).
std::vector<std::vector<SkStep>> skeleton(const std::vector<int>& tiles_per_item, const Protocol& ds_barrier) {
  std::vector<std::vector<SkStep>> prog(6);
  const int items = static_cast<int>(tiles_per_item.size());
  for (int w = 0; w < 4; ++w) {
    auto& p = prog[w];
    int gt = 0;
    for (int it = 0; it <= items; ++it) {
      const int kvb = it & 1, item = it < items ? it : -1;
      if (w == 0) {
        if (it >= 2) p.push_back({SkOp::kMWait, kKvEmpty + kvb, (it >> 1) - 1});
        p.push_back({SkOp::kWriteItem, kvb, item});
        p.push_back({SkOp::kMArrive, kItemFull + kvb, 1});
      } else {
        p.push_back({SkOp::kMWait, kItemFull + kvb, it >> 1});
        p.push_back({SkOp::kReadItem, kvb, item});
      }
      if (item < 0) break;
      p.push_back({SkOp::kMArrive, kKvFull + kvb, 1, it});  // this warp's K or V rows landed
      for (int i = 0; i < tiles_per_item[it]; ++i, ++gt) {
        const int s = gt % kStages;
        if (gt >= kStages) p.push_back({SkOp::kMWait, kEmpty + s, gt / kStages - 1});
        p.push_back({SkOp::kMArrive, kFull + s, 1, gt});  // this warp's Q or dO rows, lse2 or D landed
      }
    }
    p.push_back({SkOp::kEnd, 0, 0});
  }
  for (int c = 0; c < 2; ++c) {
    auto& p = prog[4 + c];
    int gt = 0;
    for (int it = 0; it <= items; ++it) {
      const int kvb = it & 1, item = it < items ? it : -1;
      p.push_back({SkOp::kMWait, kItemFull + kvb, it >> 1});
      p.push_back({SkOp::kReadItem, kvb, item});
      if (item < 0) break;
      p.push_back({SkOp::kMWait, kKvFull + kvb, it >> 1, it});
      for (int i = 0; i < tiles_per_item[it]; ++i, ++gt) {
        const int s = gt % kStages;
        p.push_back({SkOp::kMWait, kFull + s, gt / kStages, gt});
        p.push_back({SkOp::kNArrive, ds_barrier(gt, c), gt});
        p.push_back({SkOp::kNSync, ds_barrier(gt, 1 - c), gt});
        p.push_back({SkOp::kMArrive, kEmpty + s, 4, gt});  // release(empty + s) by each of the 4 warps
      }
      p.push_back({SkOp::kMArrive, kKvEmpty + kvb, 4, it});
    }
    p.push_back({SkOp::kEnd, 0, 0});
  }
  return prog;
}

struct SkState {
  std::vector<int> pc;
  std::vector<int> nblocked;         // named barrier the agent waits at (-1: none)
  std::vector<int> mpending, mdone;  // per mbarrier: arrivals in the current phase, completed phases
  NamedPhases named;                 // the consumers' named barriers (the producers use none)
  int item_slot[2] = {-2, -2};
  // Shared-memory data: per stage (kStages) and K/V buffer (2), the tile / item each producer warp last wrote there,
  // and the one each consumer reads there (-1: none), from its full / kv_full wait to its empty / kv_empty release.
  int written[2 * kStages][4] = {{-1, -1, -1, -1}, {-1, -1, -1, -1}, {-1, -1, -1, -1}, {-1, -1, -1, -1}};
  int reading[2 * kStages][2] = {{-1, -1}, {-1, -1}, {-1, -1}, {-1, -1}};
  std::string key() const {
    std::string k;
    const auto put = [&](int v) { put_key(k, v); };
    for (size_t i = 0; i < pc.size(); ++i) {
      put(pc[i]);
      put(nblocked[i]);
    }
    for (size_t b = 0; b < mpending.size(); ++b) {
      put(mpending[b]);
      put(mdone[b]);
    }
    named.key(k);
    put(item_slot[0]);
    put(item_slot[1]);
    for (int b = 0; b < 2 * kStages; ++b) {
      for (int w = 0; w < 4; ++w) put(written[b][w]);
      put(reading[b][0]);
      put(reading[b][1]);
    }
    return k;
  }
};

// The data buffer an mbarrier guards: stages 0..kStages-1 (full, empty), then the K/V buffers (kv_full, kv_empty).
int buffer_of(int bar) {
  if (bar >= kFull) return (bar - kFull) % kStages;
  return kStages + (bar - kKvFull) % 2;
}

Result explore_skeleton(const std::vector<std::vector<SkStep>>& prog) {
  const int agents = static_cast<int>(prog.size());
  SkState s0;
  s0.pc.assign(agents, 0);
  s0.nblocked.assign(agents, -1);
  s0.mpending.assign(kNumMbar, 0);
  s0.mdone.assign(kNumMbar, 0);
  const auto move = [&](SkState& n, int a, Result& r) {
    const auto fail = [&](const std::string& what) {
      r.violation = true;
      r.what = what;
    };
    const SkStep& st = prog[a][n.pc[a]];
    if (st.op == SkOp::kEnd || n.nblocked[a] >= 0) return false;
    const std::string where = "agent " + std::to_string(a) + " step " + std::to_string(n.pc[a]) + ": ";
    switch (st.op) {
      case SkOp::kMWait: {
        const int done = n.mdone[st.bar];
        // The hardware: try_wait.parity(k & 1) passes once the phase of that parity has completed, i.e. while the
        // current (incomplete) phase's parity differs from it.
        const bool hw_pass = (done & 1) != (st.arg & 1);
        if (done >= st.arg + 2)
          fail(where + "mbarrier " + std::to_string(st.bar) + " is two phases past the one awaited");
        if (hw_pass && done < st.arg + 1)
          fail(where + "mbarrier " + std::to_string(st.bar) + " passes a wait one phase early");
        if (r.violation) return true;
        if (!hw_pass) return false;  // not enabled yet
        if (st.data >= 0) {  // a consumer starts reading a stage or K/V buffer: every producer warp's data is there
          const int buf = buffer_of(st.bar);
          for (int w = 0; w < 4; ++w)
            if (n.written[buf][w] != st.data)
              fail(where + "buffer " + std::to_string(buf) + " holds " + std::to_string(n.written[buf][w]) +
                   " of producer warp " + std::to_string(w) + ", not " + std::to_string(st.data));
          n.reading[buf][a - 4] = st.data;
        }
        break;
      }
      case SkOp::kMArrive:
        if (st.data >= 0) {
          const int buf = buffer_of(st.bar);
          if (a < 4) {  // a producer warp's data lands: no consumer may still read what it replaces
            for (int c = 0; c < 2; ++c)
              if (n.reading[buf][c] >= 0 && n.reading[buf][c] != st.data)
                fail(where + "buffer " + std::to_string(buf) + " overwritten while consumer " + std::to_string(c) +
                     " reads it");
            n.written[buf][a] = st.data;
          } else {  // a consumer releases the buffer
            n.reading[buf][a - 4] = -1;
          }
        }
        n.mpending[st.bar] += st.arg;
        if (n.mpending[st.bar] > mbar_expected(st.bar))
          fail(where + "mbarrier " + std::to_string(st.bar) + " receives more arrivals than a phase holds");
        if (n.mpending[st.bar] == mbar_expected(st.bar)) {
          n.mpending[st.bar] = 0;
          ++n.mdone[st.bar];
        }
        break;
      case SkOp::kWriteItem:
        n.item_slot[st.bar] = st.arg;
        break;
      case SkOp::kReadItem:
        if (n.item_slot[st.bar] != st.arg)
          fail(where + "sItem[" + std::to_string(st.bar) + "] holds item " + std::to_string(n.item_slot[st.bar]) +
               ", not " + std::to_string(st.arg));
        break;
      case SkOp::kNArrive:
      case SkOp::kNSync: {  // whole consumers: a dS^T phase is one arrival of each
        const std::string what = n.named.join(st.bar, a - 4, st.arg, 2, st.op == SkOp::kNSync, a, n.nblocked);
        if (!what.empty()) fail(where + what);
        break;
      }
      case SkOp::kEnd:
        break;
    }
    ++n.pc[a];
    return true;
  };
  const auto done = [&](const SkState& s) {
    for (int a = 0; a < agents; ++a)
      if (prog[a][s.pc[a]].op != SkOp::kEnd) return false;
    return true;
  };
  return search(s0, agents, move, done);
}

TEST(FmhaWsqBarriers, WholeCtaSkeletonNeverStallsNorMisreads) {
  // Items of 1-4 query tiles (sequences up to 512 tokens) in mixed orders, including a single item and runs that
  // wrap both K/V buffers and both stages several times.
  const std::vector<std::vector<int>> runs = {{1}, {4}, {1, 1, 1, 1}, {2, 1, 3}, {4, 1, 2, 1}};
  for (const auto& tiles : runs) {
    const Result r = explore_skeleton(skeleton(tiles, ds_barrier_main));
    std::string name;
    for (int t : tiles) name += std::to_string(t) + ' ';
    EXPECT_FALSE(r.violation) << "items with tiles " << name << ": " << r.what;
    EXPECT_FALSE(r.deadlock) << "items with tiles " << name << ": " << r.what;
    EXPECT_GT(r.states, static_cast<size_t>(100)) << "items with tiles " << name;
  }
}

// Negative controls of the skeleton checker: the one-barrier protocol, and a producer that refills a stage without
// waiting for the consumers' release (the wait dropped from warp 0's program).
TEST(FmhaWsqBarriers, WholeCtaSkeletonFindsBrokenProtocols) {
  const Result one = explore_skeleton(skeleton({2, 2}, ds_barrier_one_per_consumer));
  EXPECT_TRUE(one.violation || one.deadlock) << "the checker missed the one-barrier protocol's double arrival";
  auto prog = skeleton({3}, ds_barrier_main);  // tile 2 refills stage 0 within the item
  for (size_t i = 0; i < prog[0].size(); ++i) {
    if (prog[0][i].op == SkOp::kMWait && prog[0][i].bar >= kEmpty) {
      prog[0].erase(prog[0].begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  }
  const Result early = explore_skeleton(prog);
  EXPECT_TRUE(early.violation) << "the checker missed a stage refilled before its release";
}

}  // namespace
}  // namespace nopad
