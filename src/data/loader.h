// The training data loader.
//  * EpochSampler: a deterministic permutation of the dataset per epoch (seeded by (seed, epoch)); a global batch is
//    the next `global_batch` ids of the permutation; an epoch's tail shorter than a batch is dropped. A Cursor
//    (epoch, position) says where the next batch starts, so a run resumes exactly where it stopped.
//  * RankAssigner: splits a global batch among data-parallel ranks. The default gives rank r the r-th contiguous
//    slice; the workload balancer plugs in here with its own assignment.
//  * Loader: builds this rank's unpadded HostBatch (data/batch.h) on a background thread into a ring of reusable
//    buffers, so the next batch is ready while the current step runs.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "data/batch.h"
#include "data/dataset.h"

namespace nopad {

struct Cursor {
  uint64_t epoch = 0;
  uint64_t position = 0;  // samples of this epoch's permutation already consumed
  bool operator==(const Cursor&) const = default;
};

class EpochSampler {
 public:
  EpochSampler(uint64_t dataset_size, uint64_t seed, bool shuffle = true);
  uint64_t dataset_size() const { return size_; }
  // Writes the ids of the global batch that starts at `cursor` into `ids` and advances the cursor.
  void next_global_batch(Cursor& cursor, uint64_t global_batch, std::vector<uint64_t>& ids);

 private:
  void ensure_epoch(uint64_t epoch);
  uint64_t size_, seed_;
  bool shuffle_;
  uint64_t cached_epoch_ = UINT64_MAX;
  std::vector<uint64_t> permutation_;
};

class RankAssigner {
 public:
  virtual ~RankAssigner() = default;
  // per_rank[r] receives the ids rank r trains on; together they are exactly `global_ids`.
  virtual void assign(std::span<const uint64_t> global_ids, const Dataset& dataset, int world_size,
                      std::vector<std::vector<uint64_t>>& per_rank) = 0;
};

class ContiguousAssigner final : public RankAssigner {
 public:
  void assign(std::span<const uint64_t> global_ids, const Dataset& dataset, int world_size,
              std::vector<std::vector<uint64_t>>& per_rank) override;
};

// Appends nothing: fills `out` (cleared first) with the unpadded batch of the given samples, in the given order.
void build_batch(const Dataset& dataset, std::span<const uint64_t> ids, HostBatch& out);
// Appends one sample (global id `id`) to the end of `out`: what build_batch does for each of its samples.
void append_sample(const SampleRef& s, uint64_t id, HostBatch& out);

struct LoaderOptions {
  uint64_t global_batch = 32;
  int rank = 0, world_size = 1;
  uint64_t seed = 12345;
  bool shuffle = true;
  Cursor start;
  bool background = true;  // build batches on a loader thread
  int prefetch = 2;        // batches built ahead (ring of prefetch + 1 buffers)
};

class Loader {
 public:
  Loader(const Dataset& dataset, const LoaderOptions& options, std::shared_ptr<RankAssigner> assigner = nullptr);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // This rank's next batch; the reference stays valid until the next call.
  const HostBatch& next();
  // Where the batch after the one last returned by next() starts (the position to resume from).
  Cursor cursor() const { return cursor_; }
  uint64_t steps_per_epoch() const { return dataset_.size() / options_.global_batch; }

 private:
  void produce_one(HostBatch& out, Cursor& after);
  void run();

  const Dataset& dataset_;
  LoaderOptions options_;
  std::shared_ptr<RankAssigner> assigner_;
  EpochSampler sampler_;
  Cursor producer_cursor_, cursor_;
  std::vector<uint64_t> global_ids_;
  std::vector<std::vector<uint64_t>> per_rank_;

  std::vector<HostBatch> slots_;
  std::vector<Cursor> slot_cursor_;
  std::mutex mutex_;
  std::condition_variable filled_cv_, free_cv_;
  uint64_t produced_ = 0, released_ = 0, taken_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace nopad
