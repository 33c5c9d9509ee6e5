// PartitionedData and PartitionedLoader: see partitioned.h.
#include "dist/partitioned.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/io.h"

namespace nopad::dist {
namespace {

// The shard index of a file named shard_<digits>.nopad; -1 for any other name.
int64_t shard_index(const std::filesystem::path& p) {
  const std::string name = p.filename().string(), prefix = "shard_", ext = kShardExtension;
  if (name.size() <= prefix.size() + ext.size() || !name.starts_with(prefix) || !name.ends_with(ext)) return -1;
  const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - ext.size());
  if (digits.empty() || digits.size() > 12 || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return -1;
  return std::stoll(digits);
}

// A sample on the wire, laid out so that a SampleRef can view it in place: length, a_length, nsp_label,
// num_masked (u32 each), tokens (i32 x length), mlm labels (i32 x num_masked), mlm positions (u16 x num_masked),
// zero padding to a multiple of 4 bytes (exchange_samples then keeps every payload 4-byte aligned).
void append_wire(const SampleRef& s, std::vector<uint8_t>& out) {
  const uint32_t head[4] = {s.length, s.a_length, s.nsp_label, s.num_masked};
  const size_t bytes = sizeof head + 4 * (size_t{s.length} + size_t{s.num_masked}) + 2 * size_t{s.num_masked};
  const size_t at = out.size();
  out.resize(at + (bytes + 3) / 4 * 4, 0);
  uint8_t* p = out.data() + at;
  std::memcpy(p, head, sizeof head);
  p += sizeof head;
  auto put32 = [&](int32_t v) {
    std::memcpy(p, &v, 4);
    p += 4;
  };
  for (uint32_t i = 0; i < s.length; ++i) put32(s.token(i));
  for (uint32_t k = 0; k < s.num_masked; ++k) put32(s.mlm_label(k));
  std::memcpy(p, s.mlm_positions, 2 * size_t{s.num_masked});
}

// The SampleRef of a received payload (append_wire's layout), checked against its size.
SampleRef view_wire(const uint8_t* p, size_t bytes, uint64_t id) {
  uint32_t head[4];
  NOPAD_CHECK(bytes >= sizeof head && reinterpret_cast<uintptr_t>(p) % 4 == 0, "partitioned data: sample ", id,
              " arrived truncated or misaligned (", bytes, " bytes)");
  std::memcpy(head, p, sizeof head);
  const auto [length, a_length, nsp, masked] = head;
  const size_t want = sizeof head + 4 * (size_t{length} + size_t{masked}) + 2 * size_t{masked};
  NOPAD_CHECK(bytes == (want + 3) / 4 * 4 && length >= 1 && a_length <= length, "partitioned data: sample ", id,
              " arrived malformed (", bytes, " bytes, length ", length, ", ", masked, " masked)");
  const uint8_t* tokens = p + sizeof head;
  const uint8_t* labels = tokens + 4 * size_t{length};
  return SampleRef{tokens, 4, length, a_length, nsp, reinterpret_cast<const uint16_t*>(labels + 4 * size_t{masked}),
                   labels, masked};
}

}  // namespace

PartitionedData::PartitionedData(const std::filesystem::path& dir, Communicator& comm,
                                 const ShardReader::Options& options) {
  const int rank = comm.rank(), world = comm.size();
  // This rank's part, which may fail on one rank alone (a missing shard, a bad manifest): its outcome is gathered
  // before any other collective, so every rank stops with a message instead of waiting for the one that failed.
  size_t num_shards = 0;
  std::vector<int64_t> counts;
  std::string error;
  try {
    const std::filesystem::path manifest = dir / "dataset.json";
    NOPAD_CHECK(std::filesystem::is_regular_file(manifest), "rank ", rank, ": data.placement = partitioned needs ",
                manifest.string(), " on every rank (copy the dataset's manifest next to this rank's shards)");
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_file(manifest));
    } catch (const nlohmann::json::exception& e) {
      fail("rank ", rank, ": ", manifest.string(), " is not valid JSON: ", e.what());
    }
    NOPAD_CHECK(j.contains("num_shards") && j["num_shards"].is_number_unsigned() &&
                    j["num_shards"].get<uint64_t>() > 0,
                "rank ", rank, ": ", manifest.string(), " has no num_shards");
    num_shards = j["num_shards"].get<size_t>();
    // This rank's shards: i % world == rank. Other shards in the folder are not this rank's to read.
    std::map<size_t, std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      const int64_t i = e.is_regular_file() ? shard_index(e.path()) : -1;
      if (i >= 0 && static_cast<size_t>(i) < num_shards && static_cast<int>(i % world) == rank) files[i] = e.path();
    }
    for (size_t i = static_cast<size_t>(rank); i < num_shards; i += static_cast<size_t>(world))
      NOPAD_CHECK(files.count(i), "rank ", rank, " of ", world, ": shard ", i, " of ", num_shards, " (shard i goes "
                  "to rank i % ranks) is missing from ", dir.string(), "; copy it there or use data.placement = shared");
    // Sample counts of every shard (zero where another rank holds it), summed below: every rank learns them all.
    counts.assign(num_shards, 0);
    for (const auto& [i, path] : files) {
      const ShardReader& r = held_.emplace(i, ShardReader(path, options)).first->second;
      counts[i] = static_cast<int64_t>(r.num_seqs());
      max_seq_length_ = std::max(max_seq_length_, r.header().max_seq_length);
      max_masked_ = std::max(max_masked_, r.max_num_masked());
      NOPAD_CHECK(vocab_size_ == 0 || (r.header().vocab_size == vocab_size_ && r.header().vocab_checksum ==
                  vocab_checksum_), "shard ", path.string(), " was built with another vocabulary than this rank's "
                  "other shards");
      vocab_size_ = r.header().vocab_size;
      vocab_checksum_ = r.header().vocab_checksum;
    }
  } catch (const Error& e) {
    error = e.what();
  } catch (const std::filesystem::filesystem_error& e) {
    error = str_cat("rank ", rank, ": cannot list ", dir.string(), ": ", e.what());
  }
  // Every rank's shard count (0: it failed); all must agree.
  const std::vector<uint64_t> all_n = all_gather_u64(comm, error.empty() ? num_shards : 0);
  std::string failed, differ;
  for (int r = 0; r < world; ++r) {
    const uint64_t n = all_n[static_cast<size_t>(r)];
    if (n == 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
    else if (error.empty() && n != num_shards) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!error.empty()) fail(error);
  NOPAD_CHECK(failed.empty(), "rank ", rank, ": rank(s) ", failed, " could not open their shards of the partitioned "
              "data.train (their messages say why); the job stops");
  NOPAD_CHECK(differ.empty(), "rank ", rank, ": the dataset.json of rank(s) ", differ, " lists another number of "
              "shards than this rank's (", num_shards, "): every rank needs the same manifest");
  comm.all_reduce_sum(std::span<int64_t>(counts));
  for (size_t i = 0; i < num_shards; ++i) offsets_.push_back(offsets_.back() + static_cast<uint64_t>(counts[i]));
  std::vector<double> mx = {static_cast<double>(max_seq_length_), static_cast<double>(max_masked_)};
  comm.all_reduce_max(std::span<double>(mx));
  max_seq_length_ = static_cast<uint32_t>(mx[0]);
  max_masked_ = static_cast<uint32_t>(mx[1]);
  // One vocabulary on every rank: all-gather (checksum, size) of the ranks holding shards (0: none, when there are
  // more ranks than shards; those take the others').
  const std::vector<uint64_t> sigs =
      all_gather_u64(comm, held_.empty() ? 0 : (uint64_t{vocab_checksum_} << 32) | vocab_size_);
  uint64_t first = 0;
  for (int r = 0; r < world; ++r) {
    const uint64_t other = sigs[static_cast<size_t>(r)];
    if (other == 0) continue;
    if (first == 0) first = other;
    NOPAD_CHECK(other == first, "data.placement = partitioned: rank ", r, "'s shards of ", dir.string(),
                " were built with another vocabulary than the lower ranks': a dataset must use one vocabulary");
  }
  vocab_checksum_ = static_cast<uint32_t>(first >> 32);
  vocab_size_ = static_cast<uint32_t>(first & 0xffffffffu);
}

uint64_t PartitionedData::local_samples() const {
  uint64_t n = 0;
  for (const auto& [i, r] : held_) n += r.num_seqs();
  return n;
}

std::pair<size_t, uint64_t> PartitionedData::locate(uint64_t id) const {
  NOPAD_CHECK(id < size(), "sample ", id, " outside the dataset (", size(), " samples)");
  const auto it = std::upper_bound(offsets_.begin(), offsets_.end(), id);
  const size_t s = static_cast<size_t>(it - offsets_.begin()) - 1;
  return {s, id - offsets_[s]};
}

std::optional<SampleRef> PartitionedData::find(uint64_t id) const {
  const auto [s, j] = locate(id);
  const auto it = held_.find(s);
  if (it == held_.end()) return std::nullopt;
  return it->second.sample(j);
}

PartitionedLoader::PartitionedLoader(const PartitionedData& data, Communicator& comm, const LoaderOptions& options,
                                     BalanceMode mode, CostModel cost, int max_seqs_per_rank)
    : data_(data),
      comm_(comm),
      options_(options),
      mode_(mode),
      cost_(cost),
      max_seqs_per_rank_(max_seqs_per_rank),
      sampler_(data.size(), options.seed, options.shuffle),
      cursor_(options.start) {
  NOPAD_CHECK(options.rank == comm.rank() && options.world_size == comm.size(), "PartitionedLoader: rank ",
              options.rank, " of ", options.world_size, " is not the communicator's ", comm.rank(), " of ",
              comm.size());
  NOPAD_CHECK(options.global_batch >= static_cast<uint64_t>(comm.size()) && options.global_batch <= data.size(),
              "global batch ", options.global_batch, " must be between the ", comm.size(), " ranks and the ",
              data.size(), " samples of the dataset");
}

const HostBatch& PartitionedLoader::next() {
  sampler_.next_global_batch(cursor_, options_.global_batch, ids_);
  const size_t n = ids_.size();
  // Lengths of the global batch: each rank fills those it holds, the sum gives every rank all of them.
  held_.resize(n);
  lengths64_.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    held_[i] = data_.find(ids_[i]);
    if (held_[i]) lengths64_[i] = held_[i]->length;
  }
  comm_.all_reduce_sum(std::span<int64_t>(lengths64_));
  lengths_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    NOPAD_CHECK(lengths64_[i] >= 1 && lengths64_[i] <= INT32_MAX, "partitioned data: sample ", ids_[i],
                " has length ", lengths64_[i], " summed over the ranks (held by none, or by several?)");
    lengths_[i] = static_cast<int32_t>(lengths64_[i]);
  }
  plan_balance(lengths_, comm_.size(), mode_, cost_, max_seqs_per_rank_, plan_);
  // Send what this rank holds to where the plan puts it (itself included).
  send_ids_.clear();
  dest_.clear();
  payload_.clear();
  offsets_.assign(1, 0);
  for (size_t i = 0; i < n; ++i) {
    if (!held_[i]) continue;
    send_ids_.push_back(ids_[i]);
    dest_.push_back(plan_.rank_of[i]);
    append_wire(*held_[i], payload_);
    offsets_.push_back(payload_.size());
  }
  const SampleExchange got = exchange_samples(comm_, send_ids_, dest_, payload_, offsets_);
  // This rank's samples in global-batch order (got.ids is sorted by id).
  batch_.clear();
  size_t received = 0;
  for (size_t i = 0; i < n; ++i) {
    if (plan_.rank_of[i] != comm_.rank()) continue;
    const auto it = std::lower_bound(got.ids.begin(), got.ids.end(), ids_[i]);
    NOPAD_CHECK(it != got.ids.end() && *it == ids_[i], "partitioned data: rank ", comm_.rank(), " did not receive "
                "sample ", ids_[i], " of its share");
    const size_t k = static_cast<size_t>(it - got.ids.begin());
    append_sample(view_wire(got.payload.data() + got.offsets[k], got.offsets[k + 1] - got.offsets[k], ids_[i]),
                  ids_[i], batch_);
    ++received;
  }
  NOPAD_CHECK(received == got.ids.size(), "partitioned data: rank ", comm_.rank(), " received ", got.ids.size(),
              " samples, ", received, " of them its own");
  return batch_;
}

}  // namespace nopad::dist
