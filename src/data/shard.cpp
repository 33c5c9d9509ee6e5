#include "data/shard.h"

#include <algorithm>
#include <cstring>

#include "core/crc32.h"
#include "core/error.h"

namespace nopad {

namespace {

constexpr uint64_t kAlign = 64;

uint64_t align_up(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

uint32_t header_crc(ShardFileHeader h) {
  h.header_crc = 0;
  return crc32(&h, sizeof h);
}

// Index of the first of `count` ids (T: u16 or u32) that is >= limit, or `count` when there is none. Blocks of ids
// are scanned for their maximum first (a loop the compiler vectorises), so a good section costs about a memory pass.
template <class T>
uint64_t first_id_at_or_above(const T* ids, uint64_t count, uint64_t limit) {
  constexpr uint64_t kBlock = 4096;
  for (uint64_t b = 0; b < count; b += kBlock) {
    const uint64_t e = std::min(count, b + kBlock);
    T most = 0;
    for (uint64_t i = b; i < e; ++i) most = std::max(most, ids[i]);
    if (most < limit) continue;
    for (uint64_t i = b; i < e; ++i)
      if (ids[i] >= limit) return i;
  }
  return count;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------- writer

ShardWriter::ShardWriter(std::filesystem::path path, int32_t vocab_size, uint32_t vocab_checksum)
    : path_(std::move(path)), vocab_size_(vocab_size), vocab_checksum_(vocab_checksum) {
  NOPAD_CHECK(vocab_size > 0, "shard ", path_.string(), ": vocabulary size must be positive");
}

void ShardWriter::add(const Instance& inst) {
  NOPAD_CHECK(!finished_, "shard ", path_.string(), ": add() after finish()");
  const size_t n = inst.tokens.size();
  const size_t index = a_lengths_.size();
  auto bad = [&](const auto&... what) { fail("shard ", path_.string(), ", sample ", index, ": ", what...); };
  if (n < 2 || n > kShardMaxSeqLength) bad("length ", n, " outside [2, ", kShardMaxSeqLength, "]");
  if (inst.a_length < 2 || static_cast<size_t>(inst.a_length) > n) bad("segment A length ", inst.a_length, " invalid");
  if (inst.nsp_label != 0 && inst.nsp_label != 1) bad("next-sentence label ", inst.nsp_label, " is not 0 or 1");
  if (inst.mlm_positions.size() != inst.mlm_labels.size()) bad("masked positions and labels differ in count");
  for (int32_t t : inst.tokens)
    if (t < 0 || t >= vocab_size_) bad("token id ", t, " outside the vocabulary of ", vocab_size_);
  int32_t prev = -1;
  for (size_t k = 0; k < inst.mlm_positions.size(); ++k) {
    const int32_t p = inst.mlm_positions[k];
    if (p <= prev || p >= static_cast<int32_t>(n)) bad("masked position ", p, " not ascending or outside the sequence");
    const int32_t label = inst.mlm_labels[k];
    if (label < 0 || label >= vocab_size_) bad("masked label ", label, " outside the vocabulary");
    prev = p;
  }
  tokens_.insert(tokens_.end(), inst.tokens.begin(), inst.tokens.end());
  token_offsets_.push_back(tokens_.size());
  for (size_t k = 0; k < inst.mlm_positions.size(); ++k) {
    mlm_positions_.push_back(static_cast<uint16_t>(inst.mlm_positions[k]));
    mlm_labels_.push_back(static_cast<uint32_t>(inst.mlm_labels[k]));
  }
  mlm_offsets_.push_back(mlm_positions_.size());
  a_lengths_.push_back(static_cast<uint16_t>(inst.a_length));
  nsp_labels_.push_back(static_cast<uint8_t>(inst.nsp_label));
  max_seq_length_ = std::max<uint32_t>(max_seq_length_, static_cast<uint32_t>(n));
}

uint64_t ShardWriter::finish() {
  NOPAD_CHECK(!finished_, "shard ", path_.string(), ": finish() twice");
  finished_ = true;
  const uint32_t token_bytes = vocab_size_ <= 65536 ? 2 : 4;

  auto narrow = [&](const std::vector<uint32_t>& v) {
    std::vector<uint8_t> out(v.size() * token_bytes);
    if (token_bytes == 2) {
      auto* p = reinterpret_cast<uint16_t*>(out.data());
      for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<uint16_t>(v[i]);
    } else {
      std::memcpy(out.data(), v.data(), out.size());
    }
    return out;
  };
  const std::vector<uint8_t> tokens = narrow(tokens_);
  const std::vector<uint8_t> labels = narrow(mlm_labels_);

  struct Pending {
    ShardSection id;
    uint32_t elem_bytes;
    const void* data;
    uint64_t size;
  };
  const Pending sections[kShardNumSections] = {
      {ShardSection::kTokenOffsets, 8, token_offsets_.data(), token_offsets_.size() * 8},
      {ShardSection::kMlmOffsets, 8, mlm_offsets_.data(), mlm_offsets_.size() * 8},
      {ShardSection::kALengths, 2, a_lengths_.data(), a_lengths_.size() * 2},
      {ShardSection::kNspLabels, 1, nsp_labels_.data(), nsp_labels_.size()},
      {ShardSection::kTokens, token_bytes, tokens.data(), tokens.size()},
      {ShardSection::kMlmPositions, 2, mlm_positions_.data(), mlm_positions_.size() * 2},
      {ShardSection::kMlmLabels, token_bytes, labels.data(), labels.size()},
  };

  ShardFileHeader h{};
  std::memcpy(h.magic, kShardMagic, 8);
  h.version = kShardVersion;
  h.header_bytes = sizeof(ShardFileHeader);
  h.num_seqs = a_lengths_.size();
  h.num_tokens = tokens_.size();
  h.num_masked = mlm_positions_.size();
  h.vocab_size = static_cast<uint32_t>(vocab_size_);
  h.vocab_checksum = vocab_checksum_;
  h.max_seq_length = max_seq_length_;
  h.token_bytes = token_bytes;
  h.num_sections = kShardNumSections;

  ShardSectionEntry table[kShardNumSections]{};
  uint64_t offset = align_up(sizeof h + sizeof table);
  for (uint32_t s = 0; s < kShardNumSections; ++s) {
    table[s].id = static_cast<uint32_t>(sections[s].id);
    table[s].elem_bytes = sections[s].elem_bytes;
    table[s].offset = offset;
    table[s].size_bytes = sections[s].size;
    table[s].crc32 = crc32(sections[s].data, sections[s].size);
    offset = align_up(offset + sections[s].size);
  }
  h.header_crc = header_crc(h);

  AtomicWriter out(path_);
  static const uint8_t zeros[kAlign] = {};
  out.write(&h, sizeof h);
  out.write(table, sizeof table);
  for (uint32_t s = 0; s < kShardNumSections; ++s) {
    out.write(zeros, table[s].offset - out.bytes_written());
    out.write(sections[s].data, sections[s].size);
  }
  out.write(zeros, align_up(out.bytes_written()) - out.bytes_written());
  const uint64_t size = out.bytes_written();
  out.commit();
  return size;
}

// ---------------------------------------------------------------------------------------------------------- reader

Instance SampleRef::to_instance() const {
  Instance inst;
  inst.tokens.resize(length);
  for (uint32_t i = 0; i < length; ++i) inst.tokens[i] = token(i);
  inst.a_length = static_cast<int32_t>(a_length);
  inst.nsp_label = static_cast<int32_t>(nsp_label);
  inst.mlm_positions.assign(mlm_positions, mlm_positions + num_masked);
  inst.mlm_labels.resize(num_masked);
  for (uint32_t k = 0; k < num_masked; ++k) inst.mlm_labels[k] = mlm_label(k);
  return inst;
}

ShardReader::ShardReader(const std::filesystem::path& path) : ShardReader(path, Options{}) {}

ShardReader::ShardReader(const std::filesystem::path& path, const Options& options) : file_(path) {
  const std::string name = path.string();
  const uint8_t* base = file_.data();
  const uint64_t size = file_.size();
  NOPAD_CHECK(size >= sizeof(ShardFileHeader), "shard ", name, " is truncated: ", size,
              " bytes, smaller than the 128-byte header (re-create it with nopad prepare or convert)");
  std::memcpy(&header_, base, sizeof header_);
  NOPAD_CHECK(std::memcmp(header_.magic, kShardMagic, 8) == 0, "file ", name,
              " is not a nopad shard (bad magic at offset 0)");
  NOPAD_CHECK(header_.version == kShardVersion, "shard ", name, " has format version ", header_.version,
              "; this nopad reads version ", kShardVersion);
  NOPAD_CHECK(header_.header_crc == header_crc(header_), "shard ", name,
              " is corrupted: header checksum mismatch (offset 0..127)");
  NOPAD_CHECK(header_.header_bytes == sizeof(ShardFileHeader) && header_.num_sections == kShardNumSections,
              "shard ", name, " has an unexpected header layout");
  NOPAD_CHECK(header_.token_bytes == 2 || header_.token_bytes == 4, "shard ", name, ": token width ",
              header_.token_bytes, " is not 2 or 4");
  // Every header field is bounded before anything uses it (a valid CRC only says the header was written so): later
  // code sizes buffers and tables from vocab_size and max_seq_length.
  const auto bad_field = [&](const char* field, uint64_t value, const auto&... why) {
    fail("shard ", name, " is corrupted: header field ", field, " is ", value, ", ", why...,
         " (re-create it with nopad prepare or convert)");
  };
  const uint32_t max_vocab = header_.token_bytes == 2 ? 65536u : static_cast<uint32_t>(INT32_MAX);
  if (header_.vocab_size < 1 || header_.vocab_size > max_vocab)
    bad_field("vocab_size", header_.vocab_size, "outside [1, ", max_vocab, "] for ", header_.token_bytes,
              "-byte token ids");
  if (header_.max_seq_length > kShardMaxSeqLength)
    bad_field("max_seq_length", header_.max_seq_length, "above the format's limit of ", kShardMaxSeqLength,
              " tokens");
  if (options.expect_vocab_checksum >= 0)
    NOPAD_CHECK(header_.vocab_checksum == static_cast<uint32_t>(options.expect_vocab_checksum), "shard ", name,
                " was built with another vocabulary (checksum ", header_.vocab_checksum, ", expected ",
                options.expect_vocab_checksum, "): rebuild it with this vocabulary or use the vocabulary it was made with");
  const uint64_t table_end = sizeof(ShardFileHeader) + kShardNumSections * sizeof(ShardSectionEntry);
  NOPAD_CHECK(size >= table_end, "shard ", name, " is truncated inside its section table (", size, " bytes)");

  const uint64_t n = header_.num_seqs, t = header_.num_tokens, m = header_.num_masked;
  // Counts larger than the file could hold are corruption (and would overflow the size arithmetic below).
  NOPAD_CHECK(n < size / 8 && t <= size / 2 && m <= size / 2, "shard ", name,
              " is truncated or corrupted: header counts (", n, " sequences, ", t, " tokens, ", m,
              " masked) do not fit its ", size, " bytes");
  const uint64_t tb = header_.token_bytes;
  const uint64_t expected_size[kShardNumSections + 1] = {0, (n + 1) * 8, (n + 1) * 8, n * 2, n, t * tb, m * 2, m * tb};
  const uint8_t* ptrs[kShardNumSections + 1] = {};
  for (uint32_t s = 0; s < kShardNumSections; ++s) {
    ShardSectionEntry e;
    std::memcpy(&e, base + sizeof(ShardFileHeader) + s * sizeof e, sizeof e);
    const uint64_t entry_offset = sizeof(ShardFileHeader) + s * sizeof e;
    NOPAD_CHECK(e.id == s + 1, "shard ", name, ": section table entry at offset ", entry_offset, " has id ", e.id,
                ", expected ", s + 1);
    NOPAD_CHECK(e.size_bytes == expected_size[e.id], "shard ", name, ": section ", e.id, " is ", e.size_bytes,
                " bytes, expected ", expected_size[e.id], " from the header counts");
    NOPAD_CHECK(e.offset % kAlign == 0 && e.offset >= table_end && e.offset <= size && e.size_bytes <= size - e.offset,
                "shard ", name, " is truncated or corrupted: section ", e.id, " at offset ", e.offset, " (+",
                e.size_bytes, " bytes) lies outside the ", size, "-byte file");
    if (options.verify_checksums) {
      const uint32_t c = crc32(base + e.offset, e.size_bytes);
      NOPAD_CHECK(c == e.crc32, "shard ", name, " is corrupted: checksum mismatch in section ", e.id,
                  " (bytes ", e.offset, "..", e.offset + e.size_bytes, ")");
    }
    ptrs[e.id] = base + e.offset;
  }
  token_offsets_ = reinterpret_cast<const uint64_t*>(ptrs[1]);
  mlm_offsets_ = reinterpret_cast<const uint64_t*>(ptrs[2]);
  a_lengths_ = reinterpret_cast<const uint16_t*>(ptrs[3]);
  nsp_labels_ = ptrs[4];
  tokens_ = ptrs[5];
  mlm_positions_ = reinterpret_cast<const uint16_t*>(ptrs[6]);
  mlm_labels_ = ptrs[7];

  // The index must be consistent before any sample is served (this reads only the index, not the payload).
  NOPAD_CHECK(token_offsets_[0] == 0 && token_offsets_[n] == t && mlm_offsets_[0] == 0 && mlm_offsets_[n] == m,
              "shard ", name, " is corrupted: offsets do not span the payload");
  uint64_t longest = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t len = token_offsets_[i + 1] - token_offsets_[i];
    const uint64_t masked = mlm_offsets_[i + 1] - mlm_offsets_[i];
    if (token_offsets_[i + 1] < token_offsets_[i] || mlm_offsets_[i + 1] < mlm_offsets_[i] || len < 2 ||
        len > header_.max_seq_length || masked > len || a_lengths_[i] < 2 || a_lengths_[i] > len || nsp_labels_[i] > 1)
      fail("shard ", name, " is corrupted: index entry of sample ", i, " is inconsistent (length ", len, ", masked ",
           masked, ")");
    longest = std::max(longest, len);
  }
  // The writer stores the longest sample's length; readers size per-length tables and model positions from it.
  if (header_.max_seq_length != longest)
    bad_field("max_seq_length", header_.max_seq_length, "but its longest sample has ", longest, " tokens");

  // Token ids and masked labels index the model's embeddings: with the payload read anyway for its checksums, every
  // one is checked against vocab_size here, so a bad one is named by shard and sample, not met inside the model.
  if (options.verify_checksums && (header_.token_bytes == 4 || header_.vocab_size < 65536)) {
    const auto check_ids = [&](const uint8_t* ids, uint64_t count, const uint64_t* offsets, const char* what) {
      const uint64_t k = header_.token_bytes == 2
                             ? first_id_at_or_above(reinterpret_cast<const uint16_t*>(ids), count, header_.vocab_size)
                             : first_id_at_or_above(reinterpret_cast<const uint32_t*>(ids), count, header_.vocab_size);
      if (k == count) return;
      const uint64_t i = static_cast<uint64_t>(std::upper_bound(offsets, offsets + n + 1, k) - offsets) - 1;
      const uint64_t id = header_.token_bytes == 2 ? reinterpret_cast<const uint16_t*>(ids)[k]
                                                   : reinterpret_cast<const uint32_t*>(ids)[k];
      fail("shard ", name, ", sample ", i, ": ", what, " ", id, " (entry ", k - offsets[i], " of the sample) is outside "
           "the shard's vocabulary of ", header_.vocab_size, " tokens: the shard is corrupted or was not made with "
           "this vocabulary (re-create it with nopad prepare or convert)");
    };
    check_ids(tokens_, t, token_offsets_, "token id");
    check_ids(mlm_labels_, m, mlm_offsets_, "masked label");
  }
}

uint32_t ShardReader::max_num_masked() const {
  uint32_t most = 0;
  for (uint64_t i = 0; i < num_seqs(); ++i) most = std::max(most, num_masked(i));
  return most;
}

SampleRef ShardReader::sample(uint64_t i) const {
  SampleRef r{};
  const uint64_t tb = header_.token_bytes;
  r.token_bytes = header_.token_bytes;
  r.tokens = tokens_ + token_offsets_[i] * tb;
  r.length = length(i);
  r.a_length = a_lengths_[i];
  r.nsp_label = nsp_labels_[i];
  r.mlm_positions = mlm_positions_ + mlm_offsets_[i];
  r.mlm_labels = mlm_labels_ + mlm_offsets_[i] * tb;
  r.num_masked = num_masked(i);
  return r;
}

void ShardReader::validate_samples() const {
  const std::string name = path().string();
  for (uint64_t i = 0; i < num_seqs(); ++i) {
    const SampleRef s = sample(i);
    for (uint32_t k = 0; k < s.length; ++k)
      NOPAD_CHECK(static_cast<uint32_t>(s.token(k)) < header_.vocab_size, "shard ", name, ", sample ", i,
                  ": token id ", s.token(k), " outside the vocabulary");
    int prev = -1;
    for (uint32_t k = 0; k < s.num_masked; ++k) {
      NOPAD_CHECK(s.mlm_positions[k] > prev && s.mlm_positions[k] < s.length, "shard ", name, ", sample ", i,
                  ": masked position ", s.mlm_positions[k], " invalid");
      NOPAD_CHECK(static_cast<uint32_t>(s.mlm_label(k)) < header_.vocab_size, "shard ", name, ", sample ", i,
                  ": masked label outside the vocabulary");
      prev = s.mlm_positions[k];
    }
  }
}

std::vector<std::filesystem::path> list_shards(const std::filesystem::path& dir_or_file) {
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(dir_or_file, ec);
  if (ec && !is_missing_path_error(ec)) fail_unreadable_path("dataset", dir_or_file, ec);
  if (std::filesystem::is_regular_file(st)) return {dir_or_file};
  NOPAD_CHECK(std::filesystem::is_directory(st), "dataset ", dir_or_file.string(),
              " does not exist (expected a folder of .nopad shards made by nopad prepare or nopad convert)");
  std::vector<std::filesystem::path> out;
  std::filesystem::directory_iterator it(dir_or_file, ec);
  if (ec) fail_unreadable_path("dataset folder", dir_or_file, ec);
  for (const std::filesystem::directory_iterator end; it != end;) {
    if (it->path().extension() == kShardExtension) {
      const bool regular = it->is_regular_file(ec);  // a shard may be a link; one that loops is named
      if (ec && !is_missing_path_error(ec)) fail_unreadable_path("shard", it->path(), ec);
      if (regular) out.push_back(it->path());
    }
    it.increment(ec);
    if (ec) fail_unreadable_path("dataset folder", dir_or_file, ec);
  }
  std::sort(out.begin(), out.end());
  NOPAD_CHECK(!out.empty(), "dataset folder ", dir_or_file.string(), " holds no .nopad shards");
  return out;
}

}  // namespace nopad
