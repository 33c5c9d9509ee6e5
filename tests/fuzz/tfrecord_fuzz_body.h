// Fuzz body of the TFRecord importer (data/tfrecord_import.h): the bytes are a .tfrecord file, read with and without
// the [CLS]/[SEP] checks; every instance it hands on must satisfy check_instance and add up to its summary. A file
// whose framing checksums are wrong is also read with them repaired, so that mutated records reach the
// tf.train.Example parser behind the checksums.
#pragma once
#include <cstring>
#include <string>

#include "core/crc32.h"
#include "core/error.h"
#include "data/tfrecord_import.h"
#include "fuzz_common.h"
#include "instance_check.h"

namespace nopad::fuzz {

// The bytes with every record's two masked CRC-32C values recomputed (as far as the framing reaches); false when
// they were right already.
inline bool repair_tfrecord(std::string& b) {
  bool changed = false;
  auto set_crc = [&](size_t at, const void* what, size_t n) {
    const uint32_t crc = crc32c_mask(crc32c(what, n));
    if (std::memcmp(b.data() + at, &crc, 4) != 0) changed = true;
    std::memcpy(b.data() + at, &crc, 4);
  };
  size_t off = 0;
  while (b.size() - off >= 12) {
    uint64_t len;
    std::memcpy(&len, b.data() + off, 8);
    set_crc(off + 8, b.data() + off, 8);
    if (len > b.size() - off - 12 || b.size() - off - 12 - len < 4) break;
    set_crc(off + 12 + len, b.data() + off + 12, len);
    off += 16 + len;
  }
  return changed;
}

inline void tfrecord_read_checked(const std::filesystem::path& file) {
  for (const InstanceRules rules : {InstanceRules{30522, -1, -1}, InstanceRules{30522, 101, 102}}) {
    uint64_t records = 0, tokens = 0, masked = 0;
    try {
      const TfRecordSummary s = read_tfrecord_instances(file, rules, [&](Instance&& inst) {
        check_instance(inst, rules.vocab_size);
        ++records;
        tokens += inst.tokens.size();
        masked += inst.mlm_positions.size();
      });
      require(s.num_records == records && s.num_tokens == tokens && s.num_masked == masked,
              "the summary counts what was handed on");
    } catch (const Error&) {
    }
  }
}

inline void tfrecord_fuzz_one(const uint8_t* data, size_t size) {
  const std::filesystem::path file = scratch_dir() / "input.tfrecord";
  write_bytes(file, data, size);
  tfrecord_read_checked(file);
  std::string repaired(reinterpret_cast<const char*>(data), size);
  if (repair_tfrecord(repaired)) {
    write_bytes(file, reinterpret_cast<const uint8_t*>(repaired.data()), repaired.size());
    tfrecord_read_checked(file);
  }
}

}  // namespace nopad::fuzz
