// Fuzz body of the TensorFlow checkpoint reader (train/tf_checkpoint.h). A checkpoint is two files, so the bytes are
// split: a little-endian u32 N, then N bytes of PREFIX.index, then the rest as PREFIX.data-00000-of-00001
// (scripts/fuzz-corpus.py writes its seeds so). The checkpoint is opened, every floating-point tensor read, and the
// weights of a tiny BERT loaded from it (the name mapping and shape checks of load_tf_bert_weights). An index whose
// table blocks fail their checksums is also read with them repaired, so that mutated blocks reach the table and
// protobuf parsers behind the checksums.
#pragma once
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/crc32.h"
#include "core/error.h"
#include "core/protowire.h"
#include "model/params.h"
#include "train/tf_checkpoint.h"
#include "fuzz_common.h"

namespace nopad::fuzz {

// The model of the tf_checkpoint seeds (scripts/fuzz-corpus.py, TINY_BERT).
inline BertConfig tf_fuzz_bert_config() {
  BertConfig c;
  c.hidden_size = 4;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.intermediate_size = 8;
  c.vocab_size = 8;
  c.max_position_embeddings = 8;
  c.type_vocab_size = 2;
  return c;
}

// Recomputes the trailer checksum of the table block at [offset, offset + size) when it lies inside `index`.
inline bool repair_tf_block(std::string& index, uint64_t offset, uint64_t size) {
  if (offset > index.size() || size > index.size() - offset || index.size() - offset - size < 5) return false;
  const uint32_t crc = crc32c_mask(crc32c(index.data() + offset, size + 1));
  const bool changed = std::memcmp(index.data() + offset + size + 1, &crc, 4) != 0;
  std::memcpy(index.data() + offset + size + 1, &crc, 4);
  return changed;
}

// The index with the checksums of its index block and of every data block it names recomputed, as far as the footer
// and the index block can be parsed; false when nothing changed.
inline bool repair_tf_index(std::string& index) {
  if (index.size() < 48) return false;
  bool changed = false;
  const std::string where = "fuzz repair";
  try {
    WireCursor footer(reinterpret_cast<const uint8_t*>(index.data()) + index.size() - 48, 40, &where);
    footer.varint("footer");
    footer.varint("footer");
    const uint64_t offset = footer.varint("footer"), size = footer.varint("footer");
    changed |= repair_tf_block(index, offset, size);
    if (offset > index.size() || size > index.size() - offset || size < 4) return changed;
    const auto* block = reinterpret_cast<const uint8_t*>(index.data()) + offset;
    uint32_t restarts;
    std::memcpy(&restarts, block + size - 4, 4);
    if (restarts > (size - 4) / 4) return changed;
    WireCursor c(block, size - 4 - 4 * static_cast<size_t>(restarts), &where);
    while (!c.done()) {
      c.varint("entry");
      const uint64_t non_shared = c.varint("entry"), value_size = c.varint("entry");
      c.bytes(non_shared, "key");
      WireCursor handle(c.bytes(value_size, "value"), value_size, &where);
      const uint64_t off = handle.varint("handle"), n = handle.varint("handle");
      changed |= repair_tf_block(index, off, n);
    }
  } catch (const Error&) {
  }
  return changed;
}

inline void tf_checkpoint_read(const std::filesystem::path& prefix) {
  try {
    const TfCheckpoint ck(prefix);
    for (const TfTensorEntry& e : ck.tensors()) {
      require(ck.find(e.name) == &e, "every tensor is found by its name");
      unsigned __int128 product = 1;  // the shape's element count, without wrapping around
      for (const int64_t d : e.shape) product = product > UINT64_MAX ? product : product * static_cast<uint64_t>(d);
      require(product == e.numel, "numel is the product of the shape");
      if (e.sliced || !e.known_dtype || !is_float_dtype(e.dtype)) continue;
      try {
        const std::vector<float> values = ck.read_float(e.name);
        require(values.size() == e.numel, "numel values");
      } catch (const Error&) {
      }
    }
  } catch (const Error&) {
    return;
  }
  static const ParamLayout layout(tf_fuzz_bert_config());
  std::vector<float> params(layout.total_numel());
  try {
    load_tf_bert_weights(prefix, layout, params.data());
  } catch (const Error&) {
  }
}

inline void tf_checkpoint_fuzz_one(const uint8_t* data, size_t size) {
  uint32_t index_size = static_cast<uint32_t>(size);
  size_t skip = 0;
  if (size >= 4) {
    std::memcpy(&index_size, data, 4);
    skip = 4;
  }
  const size_t n_index = std::min<size_t>(index_size, size - skip);
  const std::filesystem::path prefix = scratch_dir() / "model.ckpt-1";
  std::string index(reinterpret_cast<const char*>(data) + skip, n_index);
  write_bytes(prefix.string() + ".index", reinterpret_cast<const uint8_t*>(index.data()), index.size());
  write_bytes(prefix.string() + ".data-00000-of-00001", data + skip + n_index, size - skip - n_index);
  tf_checkpoint_read(prefix);
  if (repair_tf_index(index)) {
    write_bytes(prefix.string() + ".index", reinterpret_cast<const uint8_t*>(index.data()), index.size());
    tf_checkpoint_read(prefix);
  }
}

}  // namespace nopad::fuzz
