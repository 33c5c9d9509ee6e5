#include "data/loader.h"

#include <algorithm>

#include "core/error.h"
#include "core/rng.h"

namespace nopad {

EpochSampler::EpochSampler(uint64_t dataset_size, uint64_t seed, bool shuffle)
    : size_(dataset_size), seed_(seed), shuffle_(shuffle) {}

void EpochSampler::ensure_epoch(uint64_t epoch) {
  if (epoch == cached_epoch_) return;
  permutation_.resize(size_);
  for (uint64_t i = 0; i < size_; ++i) permutation_[i] = i;
  if (shuffle_) {
    Rng rng({seed_, 0x65706f6368ull /* "epoch" */, epoch});
    rng.shuffle(permutation_.begin(), permutation_.end());
  }
  cached_epoch_ = epoch;
}

void EpochSampler::next_global_batch(Cursor& cursor, uint64_t global_batch, std::vector<uint64_t>& ids) {
  NOPAD_CHECK(global_batch >= 1 && global_batch <= size_, "global batch of ", global_batch,
              " sequences does not fit a dataset of ", size_, " sequences");
  if (cursor.position + global_batch > size_) {  // drop the epoch's short tail
    ++cursor.epoch;
    cursor.position = 0;
  }
  ensure_epoch(cursor.epoch);
  ids.assign(permutation_.begin() + static_cast<std::ptrdiff_t>(cursor.position),
             permutation_.begin() + static_cast<std::ptrdiff_t>(cursor.position + global_batch));
  cursor.position += global_batch;
}

void ContiguousAssigner::assign(std::span<const uint64_t> global_ids, const Dataset&, int world_size,
                                std::vector<std::vector<uint64_t>>& per_rank) {
  per_rank.resize(static_cast<size_t>(world_size));
  const size_t n = global_ids.size(), w = static_cast<size_t>(world_size);
  for (size_t r = 0; r < w; ++r) {
    const size_t begin = n * r / w, end = n * (r + 1) / w;
    per_rank[r].assign(global_ids.begin() + static_cast<std::ptrdiff_t>(begin),
                       global_ids.begin() + static_cast<std::ptrdiff_t>(end));
  }
}

void build_batch(const Dataset& dataset, std::span<const uint64_t> ids, HostBatch& out) {
  out.clear();
  for (const uint64_t id : ids) append_sample(dataset.sample(id), id, out);
}

void append_sample(const SampleRef& s, uint64_t id, HostBatch& out) {
  const auto row0 = static_cast<int32_t>(out.tokens.size());
  const size_t old = out.tokens.size();
  out.tokens.resize(old + s.length);
  out.positions.resize(old + s.length);
  out.segments.resize(old + s.length);
  int32_t* tok = out.tokens.data() + old;
  int32_t* pos = out.positions.data() + old;
  int32_t* seg = out.segments.data() + old;
  if (s.token_bytes == 2) {
    const auto* src = static_cast<const uint16_t*>(s.tokens);
    for (uint32_t i = 0; i < s.length; ++i) tok[i] = src[i];
  } else {
    const auto* src = static_cast<const int32_t*>(s.tokens);
    std::copy(src, src + s.length, tok);
  }
  for (uint32_t i = 0; i < s.length; ++i) {
    pos[i] = static_cast<int32_t>(i);
    seg[i] = i < s.a_length ? 0 : 1;
  }
  for (uint32_t k = 0; k < s.num_masked; ++k) {
    out.mlm_positions.push_back(row0 + s.mlm_positions[k]);
    out.mlm_labels.push_back(s.mlm_label(k));
  }
  out.cu_seqlens.push_back(row0 + static_cast<int32_t>(s.length));
  out.max_seqlen = std::max(out.max_seqlen, static_cast<int32_t>(s.length));
  out.nsp_labels.push_back(static_cast<int32_t>(s.nsp_label));
  out.sample_ids.push_back(id);
}

Loader::Loader(const Dataset& dataset, const LoaderOptions& options, std::shared_ptr<RankAssigner> assigner)
    : dataset_(dataset),
      options_(options),
      assigner_(assigner ? std::move(assigner) : std::make_shared<ContiguousAssigner>()),
      sampler_(dataset.size(), options.seed, options.shuffle),
      producer_cursor_(options.start),
      cursor_(options.start) {
  NOPAD_CHECK(options.world_size >= 1 && options.rank >= 0 && options.rank < options.world_size, "rank ",
              options.rank, " is outside a world of ", options.world_size);
  NOPAD_CHECK(options.global_batch >= static_cast<uint64_t>(options.world_size), "global batch ",
              options.global_batch, " is smaller than the ", options.world_size, " ranks");
  NOPAD_CHECK(options.global_batch <= dataset.size(), "global batch ", options.global_batch,
              " is larger than the dataset (", dataset.size(), " sequences)");
  slots_.resize(static_cast<size_t>(std::max(1, options.prefetch) + 1));
  slot_cursor_.resize(slots_.size());
  if (options_.background) thread_ = std::thread([this] { run(); });
}

Loader::~Loader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  free_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Loader::produce_one(HostBatch& out, Cursor& after) {
  sampler_.next_global_batch(producer_cursor_, options_.global_batch, global_ids_);
  assigner_->assign(global_ids_, dataset_, options_.world_size, per_rank_);
  build_batch(dataset_, per_rank_[static_cast<size_t>(options_.rank)], out);
  after = producer_cursor_;
}

void Loader::run() {
  try {
    for (;;) {
      uint64_t slot;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        free_cv_.wait(lock, [&] { return stop_ || produced_ - released_ < slots_.size(); });
        if (stop_) return;
        slot = produced_ % slots_.size();
      }
      // The slot is free: the consumer has released it and will not touch it until produced_ moves past it.
      produce_one(slots_[slot], slot_cursor_[slot]);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++produced_;
      }
      filled_cv_.notify_one();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = std::current_exception();
    filled_cv_.notify_all();
  }
}

const HostBatch& Loader::next() {
  if (!options_.background) {
    HostBatch& out = slots_[0];
    produce_one(out, cursor_);
    return out;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  released_ = taken_;  // the batch returned last time is free again
  free_cv_.notify_one();
  filled_cv_.wait(lock, [&] { return produced_ > taken_ || error_; });
  if (produced_ <= taken_ && error_) std::rethrow_exception(error_);
  const uint64_t slot = taken_ % slots_.size();
  ++taken_;
  cursor_ = slot_cursor_[slot];
  return slots_[slot];
}

}  // namespace nopad
