// nopad's shard format (byte layout in docs/data-format.md): one file of pre-training instances, laid out in
// columns so that a training loop can memory-map it and reach any sample and every sequence length in O(1)
// without reading the token payload. Each section carries a CRC-32; the header carries the vocabulary checksum.
//
// ShardWriter collects instances in memory and writes the file atomically in finish().
// ShardReader maps a file, validates header, section table and index, and (by default) every section's checksum;
// any inconsistency throws nopad::Error naming the file and the offset.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/io.h"
#include "data/instance.h"

namespace nopad {

inline constexpr char kShardMagic[8] = {'N', 'O', 'P', 'A', 'D', 'S', 'H', 'D'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr const char* kShardExtension = ".nopad";

enum class ShardSection : uint32_t {
  kTokenOffsets = 1,  // u64[N+1]: sequence i's tokens are tokens[off[i], off[i+1])
  kMlmOffsets = 2,    // u64[N+1]: sequence i's masked positions/labels are [moff[i], moff[i+1])
  kALengths = 3,      // u16[N]: tokens with segment id 0 ([CLS] A [SEP])
  kNspLabels = 4,     // u8[N]: 0 IsNext, 1 random
  kTokens = 5,        // u16[T] or u32[T] (header.token_bytes)
  kMlmPositions = 6,  // u16[M]: positions within the sequence, ascending
  kMlmLabels = 7,     // u16[M] or u32[M]: original token ids
};
inline constexpr uint32_t kShardNumSections = 7;
inline constexpr uint32_t kShardMaxSeqLength = 65535;  // masked positions are u16

#pragma pack(push, 1)
struct ShardFileHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;  // sizeof(ShardFileHeader)
  uint64_t num_seqs;
  uint64_t num_tokens;
  uint64_t num_masked;
  uint32_t vocab_size;
  uint32_t vocab_checksum;
  uint32_t max_seq_length;  // longest sequence stored
  uint32_t token_bytes;     // 2 or 4
  uint32_t num_sections;
  uint32_t flags;
  uint8_t reserved[60];
  uint32_t header_crc;  // CRC-32 of this header with header_crc = 0
};
struct ShardSectionEntry {
  uint32_t id;
  uint32_t elem_bytes;
  uint64_t offset;  // from the start of the file, multiple of 64
  uint64_t size_bytes;
  uint32_t crc32;
  uint32_t reserved;
};
#pragma pack(pop)
static_assert(sizeof(ShardFileHeader) == 128);
static_assert(sizeof(ShardSectionEntry) == 32);

class ShardWriter {
 public:
  ShardWriter(std::filesystem::path path, int32_t vocab_size, uint32_t vocab_checksum);
  // Validates the instance (layout, ids < vocab_size, positions inside, ascending) and appends it.
  void add(const Instance& inst);
  size_t num_seqs() const { return a_lengths_.size(); }
  // Writes the file atomically; returns its size in bytes.
  uint64_t finish();

 private:
  std::filesystem::path path_;
  int32_t vocab_size_;
  uint32_t vocab_checksum_;
  uint32_t max_seq_length_ = 0;
  std::vector<uint64_t> token_offsets_{0}, mlm_offsets_{0};
  std::vector<uint16_t> a_lengths_;
  std::vector<uint8_t> nsp_labels_;
  std::vector<uint32_t> tokens_, mlm_labels_;
  std::vector<uint16_t> mlm_positions_;
  bool finished_ = false;
};

// A zero-copy view of one stored sample.
struct SampleRef {
  const void* tokens;  // token_bytes wide
  uint32_t token_bytes;
  uint32_t length;
  uint32_t a_length;
  uint32_t nsp_label;
  const uint16_t* mlm_positions;
  const void* mlm_labels;  // token_bytes wide
  uint32_t num_masked;

  int32_t token(uint32_t i) const {
    return token_bytes == 2 ? static_cast<const uint16_t*>(tokens)[i] : static_cast<const int32_t*>(tokens)[i];
  }
  int32_t mlm_label(uint32_t i) const {
    return token_bytes == 2 ? static_cast<const uint16_t*>(mlm_labels)[i]
                            : static_cast<const int32_t*>(mlm_labels)[i];
  }
  Instance to_instance() const;
};

class ShardReader {
 public:
  struct Options {
    // Every section's CRC-32, and every token id and masked label < vocab_size (both read the whole payload).
    bool verify_checksums = true;
    // When set (>= 0), the shard's vocabulary checksum must equal it.
    int64_t expect_vocab_checksum = -1;
  };
  ShardReader() = default;
  explicit ShardReader(const std::filesystem::path& path);
  ShardReader(const std::filesystem::path& path, const Options& options);

  const ShardFileHeader& header() const { return header_; }
  const std::filesystem::path& path() const { return file_.path(); }
  uint64_t num_seqs() const { return header_.num_seqs; }
  uint32_t length(uint64_t i) const { return static_cast<uint32_t>(token_offsets_[i + 1] - token_offsets_[i]); }
  uint32_t num_masked(uint64_t i) const { return static_cast<uint32_t>(mlm_offsets_[i + 1] - mlm_offsets_[i]); }
  uint32_t max_num_masked() const;  // most masked positions of one sample (a pass over the offsets)
  SampleRef sample(uint64_t i) const;
  // Full check of every sample's contents (token ids < vocab, layout, masked positions); throws on the first bad one.
  void validate_samples() const;

 private:
  MappedFile file_;
  ShardFileHeader header_{};
  const uint64_t* token_offsets_ = nullptr;
  const uint64_t* mlm_offsets_ = nullptr;
  const uint16_t* a_lengths_ = nullptr;
  const uint8_t* nsp_labels_ = nullptr;
  const uint8_t* tokens_ = nullptr;
  const uint16_t* mlm_positions_ = nullptr;
  const uint8_t* mlm_labels_ = nullptr;
};

// The shard files of a dataset folder (every *.nopad, sorted by name), or the single file given.
std::vector<std::filesystem::path> list_shards(const std::filesystem::path& dir_or_file);

}  // namespace nopad
