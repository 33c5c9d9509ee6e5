// Training data partitioned across ranks (data.placement = partitioned, docs/distributed.md): each rank holds only
// some shards of a dataset on its own disk, and every global batch is assembled by exchanging samples over the host
// communicator.
//
// Contract:
//  - Shard i of a dataset of N shards (dataset.json's num_shards; files shard_<i>.nopad as nopad prepare and
//    nopad convert name them) belongs to rank i % W. Rank r opens exactly its shards (other shards in its folder are
//    ignored; a missing one of its own is an error naming it) and dataset.json, which every rank needs.
//  - The global sample ids are those of the whole dataset opened in one place: shards in index order, samples in
//    shard order. Construction is collective (the ranks all-gather their shards' sample counts), so every rank knows
//    the global size and where each shard starts.
//  - PartitionedLoader::next() is collective and runs on the thread that owns the communicator (MPI is initialised
//    FUNNELED): every rank draws the same global batch from EpochSampler (same seed and cursor as Loader), the
//    lengths of its samples are summed over the ranks so every rank plans the same balance (plan_balance), and each
//    rank sends the samples it holds to the ranks the plan gives them (one all_to_all_v: exchange_samples). A rank's
//    batch holds its planned samples in global-batch order: exactly the batch Loader + BalancedAssigner would build
//    from the whole dataset on one disk.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "data/batch.h"
#include "data/loader.h"
#include "data/shard.h"
#include "dist/balance.h"
#include "dist/comm.h"

namespace nopad::dist {

class PartitionedData {
 public:
  PartitionedData(const std::filesystem::path& dir, Communicator& comm, const ShardReader::Options& options = {});

  uint64_t size() const { return offsets_.back(); }  // samples of the whole dataset (every rank's shards)
  size_t num_shards() const { return offsets_.size() - 1; }
  uint64_t local_samples() const;                    // samples in this rank's shards
  std::optional<SampleRef> find(uint64_t id) const;  // the sample, when one of this rank's shards holds it
  uint32_t max_seq_length() const { return max_seq_length_; }  // over all ranks' shards
  uint32_t max_masked() const { return max_masked_; }          // most masked positions of a sample, all ranks
  uint32_t vocab_size() const { return vocab_size_; }
  uint32_t vocab_checksum() const { return vocab_checksum_; }

 private:
  std::pair<size_t, uint64_t> locate(uint64_t id) const;  // shard index, sample within it
  std::vector<uint64_t> offsets_{0};                      // [num_shards + 1] global start of each shard
  std::map<size_t, ShardReader> held_;                    // this rank's shards by index
  uint32_t max_seq_length_ = 0, max_masked_ = 0, vocab_size_ = 0, vocab_checksum_ = 0;
};

class PartitionedLoader {
 public:
  // options.rank and world_size must be the communicator's; background is ignored (next() is collective).
  PartitionedLoader(const PartitionedData& data, Communicator& comm, const LoaderOptions& options, BalanceMode mode,
                    CostModel cost, int max_seqs_per_rank);
  const HostBatch& next();  // collective; the reference stays valid until the next call
  Cursor cursor() const { return cursor_; }
  const BalancePlan& last_plan() const { return plan_; }

 private:
  const PartitionedData& data_;
  Communicator& comm_;
  LoaderOptions options_;
  BalanceMode mode_;
  CostModel cost_;
  int max_seqs_per_rank_;
  EpochSampler sampler_;
  Cursor cursor_;
  // Per-batch working memory, kept so that a step reuses its capacity.
  std::vector<uint64_t> ids_, send_ids_;
  std::vector<std::optional<SampleRef>> held_;
  std::vector<int64_t> lengths64_;
  std::vector<int32_t> lengths_, dest_;
  std::vector<uint8_t> payload_;
  std::vector<size_t> offsets_;
  BalancePlan plan_;
  HostBatch batch_;
};

}  // namespace nopad::dist
