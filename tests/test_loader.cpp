// The loader: deterministic epochs, unpadded batch layout, background == synchronous, resume from a cursor,
// rank splits that cover the global batch exactly once.
#include <gtest/gtest.h>

#include <set>

#include "core/error.h"
#include "data/loader.h"
#include "test_util.h"

namespace nopad {
namespace {

struct Fixture {
  test::TempDir dir{"loader"};
  std::vector<Instance> instances = test::write_random_dataset(dir.path(), 257, 3, 42, 96);
  Dataset ds{dir.path()};
};

TEST(Loader, EpochsArePermutationsAndSeeded) {
  EpochSampler a(100, 7), b(100, 7), c(100, 8);
  Cursor ca, cb, cc;
  std::vector<uint64_t> ia, ib, ic;
  std::set<uint64_t> seen;
  for (int step = 0; step < 10; ++step) {  // 10 x 10 = one epoch exactly
    a.next_global_batch(ca, 10, ia);
    b.next_global_batch(cb, 10, ib);
    c.next_global_batch(cc, 10, ic);
    EXPECT_EQ(ia, ib);
    seen.insert(ia.begin(), ia.end());
  }
  EXPECT_EQ(seen.size(), 100u);
  EXPECT_EQ(ca, (Cursor{0, 100}));
  a.next_global_batch(ca, 10, ia);  // next epoch: a new order
  EXPECT_EQ(ca, (Cursor{1, 10}));
  EpochSampler again(100, 7);
  Cursor c0;
  std::vector<uint64_t> first;
  again.next_global_batch(c0, 10, first);
  EXPECT_NE(ia, first);
  // A tail shorter than the batch is dropped: 100 / 30 -> 3 batches per epoch.
  EpochSampler d(100, 1);
  Cursor cd;
  std::vector<uint64_t> id;
  for (int i = 0; i < 4; ++i) d.next_global_batch(cd, 30, id);
  EXPECT_EQ(cd, (Cursor{1, 30}));
}

TEST(Loader, BatchLayoutMatchesSamples) {
  Fixture f;
  const std::vector<uint64_t> ids = {5, 0, 256, 100};
  HostBatch b;
  b.tokens.assign(7, -9);  // stale contents must be replaced
  build_batch(f.ds, ids, b);
  ASSERT_EQ(b.num_seqs(), 4);
  ASSERT_EQ(b.cu_seqlens.size(), 5u);
  int32_t max_len = 0, mask_row = 0;
  for (size_t k = 0; k < ids.size(); ++k) {
    const Instance& inst = f.instances[ids[k]];
    const int32_t start = b.cu_seqlens[k], len = b.cu_seqlens[k + 1] - start;
    ASSERT_EQ(len, static_cast<int32_t>(inst.tokens.size()));
    max_len = std::max(max_len, len);
    for (int32_t i = 0; i < len; ++i) {
      EXPECT_EQ(b.tokens[static_cast<size_t>(start + i)], inst.tokens[static_cast<size_t>(i)]);
      EXPECT_EQ(b.positions[static_cast<size_t>(start + i)], i);
      EXPECT_EQ(b.segments[static_cast<size_t>(start + i)], i < inst.a_length ? 0 : 1);
    }
    for (size_t m = 0; m < inst.mlm_positions.size(); ++m, ++mask_row) {
      EXPECT_EQ(b.mlm_positions[static_cast<size_t>(mask_row)], start + inst.mlm_positions[m]);
      EXPECT_EQ(b.mlm_labels[static_cast<size_t>(mask_row)], inst.mlm_labels[m]);
    }
    EXPECT_EQ(b.nsp_labels[k], inst.nsp_label);
    EXPECT_EQ(b.sample_ids[k], ids[k]);
  }
  EXPECT_EQ(b.max_seqlen, max_len);
  EXPECT_EQ(b.num_tokens(), b.cu_seqlens.back());
  EXPECT_EQ(b.num_masked(), mask_row);
}

std::vector<std::vector<uint64_t>> take(Loader& l, int steps) {
  std::vector<std::vector<uint64_t>> out;
  for (int i = 0; i < steps; ++i) out.push_back(l.next().sample_ids);
  return out;
}

TEST(Loader, BackgroundEqualsSyncAndResumes) {
  Fixture f;
  LoaderOptions o;
  o.global_batch = 16;
  o.seed = 3;
  o.background = false;
  Loader sync(f.ds, o);
  const auto expected = take(sync, 40);  // crosses two epoch boundaries (16 steps per epoch)
  o.background = true;
  Loader bg(f.ds, o);
  EXPECT_EQ(take(bg, 40), expected);

  // Stop after 23 steps, resume from the cursor: the same next 17 batches.
  Loader first(f.ds, o);
  take(first, 23);
  LoaderOptions resumed = o;
  resumed.start = first.cursor();
  EXPECT_EQ(resumed.start.epoch, 1u);
  Loader second(f.ds, resumed);
  const auto rest = take(second, 17);
  for (int i = 0; i < 17; ++i) EXPECT_EQ(rest[static_cast<size_t>(i)], expected[static_cast<size_t>(23 + i)]);
}

TEST(Loader, RanksSplitTheGlobalBatchExactly) {
  Fixture f;
  LoaderOptions o;
  o.global_batch = 12;
  o.world_size = 3;
  o.seed = 9;
  LoaderOptions whole = o;
  whole.world_size = 1;
  Loader all(f.ds, whole);
  std::vector<std::unique_ptr<Loader>> ranks;
  for (int r = 0; r < 3; ++r) {
    o.rank = r;
    ranks.push_back(std::make_unique<Loader>(f.ds, o));
  }
  for (int step = 0; step < 30; ++step) {
    const auto global = all.next().sample_ids;
    std::vector<uint64_t> joined;
    for (auto& l : ranks) {
      const auto& ids = l->next().sample_ids;
      EXPECT_EQ(ids.size(), 4u);
      joined.insert(joined.end(), ids.begin(), ids.end());
    }
    EXPECT_EQ(joined, global);
  }
}

TEST(Loader, RejectsImpossibleBatches) {
  Fixture f;
  LoaderOptions o;
  o.global_batch = 1000;
  EXPECT_THROW(Loader(f.ds, o), Error);
  o.global_batch = 2;
  o.world_size = 4;
  EXPECT_THROW(Loader(f.ds, o), Error);
}

}  // namespace
}  // namespace nopad
