// Reads BERT pre-training TFRecord files (tf.train.Example records) into Instances; see tfrecord_import.h.
#include "data/tfrecord_import.h"

#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "core/crc32.h"
#include "core/error.h"
#include "core/io.h"
#include "core/protowire.h"

namespace nopad {
namespace {

constexpr const char* kHint = " (is this a BERT pre-training TFRecord written by create_pretraining_data.py?)";

// One feature's values: an int64_list (saturated to int32: out-of-range values then fail the range checks) or a
// float_list.
struct FeatureValues {
  bool present = false;
  bool is_float = false;
  std::vector<int32_t> ints;
  std::vector<float> floats;
};

// The features create_pretraining_data.py writes, in the order of kFeatureNames.
enum FeatureId { kInputIds, kInputMask, kSegmentIds, kPositions, kLabels, kWeights, kNsp, kNumFeatures };
constexpr std::string_view kFeatureNames[kNumFeatures] = {"input_ids",           "input_mask",    "segment_ids",
                                                          "masked_lm_positions", "masked_lm_ids", "masked_lm_weights",
                                                          "next_sentence_labels"};

int32_t saturate(int64_t v) {
  return static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(v, std::numeric_limits<int32_t>::min()),
                                                std::numeric_limits<int32_t>::max()));
}

// Int64List / FloatList: repeated value = 1, packed (one length-delimited field) or not (one field per value).
void parse_list(const WireField& list, bool is_float, FeatureValues& out, const std::string& where) {
  WireCursor c(list.data, list.size, &where);
  WireField f;
  while (next_wire_field(c, f, "feature values")) {
    if (f.number != 1) continue;
    if (f.wire == 2) {
      WireCursor p(f.data, f.size, &where);
      if (is_float) {
        NOPAD_CHECK(f.size % 4 == 0, where, ": a packed float list of ", f.size, " bytes");
        for (size_t i = 0; i < f.size; i += 4) {
          float v;
          std::memcpy(&v, f.data + i, 4);
          out.floats.push_back(v);
        }
      } else {
        while (!p.done()) out.ints.push_back(saturate(static_cast<int64_t>(p.varint("packed int64 list"))));
      }
    } else if (is_float && f.wire == 5) {
      float v;
      const auto bits = static_cast<uint32_t>(f.value);
      std::memcpy(&v, &bits, 4);
      out.floats.push_back(v);
    } else if (!is_float && f.wire == 0) {
      out.ints.push_back(saturate(static_cast<int64_t>(f.value)));
    }
  }
}

// Example { Features features = 1 }, Features { map<string, Feature> feature = 1 }, Feature { oneof bytes_list = 1,
// float_list = 2, int64_list = 3 }.
void parse_example(const uint8_t* data, size_t size, const RecordPlace& place, const std::string& where,
                   FeatureValues (&features)[kNumFeatures]) {
  for (FeatureValues& f : features) f = FeatureValues{};
  WireCursor ex(data, size, &where);
  WireField top;
  while (next_wire_field(ex, top, "tf.train.Example")) {
    if (top.number != 1 || top.wire != 2) continue;
    WireCursor fs(top.data, top.size, &where);
    WireField entry;
    while (next_wire_field(fs, entry, "tf.train.Features")) {
      if (entry.number != 1 || entry.wire != 2) continue;
      WireCursor e(entry.data, entry.size, &where);
      WireField kv;
      std::string_view key;
      WireField value;
      bool have_value = false;
      while (next_wire_field(e, kv, "feature map entry")) {
        if (kv.number == 1 && kv.wire == 2) key = std::string_view(reinterpret_cast<const char*>(kv.data), kv.size);
        if (kv.number == 2 && kv.wire == 2) {
          value = kv;
          have_value = true;
        }
      }
      int id = -1;
      for (int i = 0; i < kNumFeatures; ++i)
        if (key == kFeatureNames[i]) id = i;
      if (id < 0 || !have_value) continue;
      FeatureValues& out = features[id];
      out = FeatureValues{};  // a key given twice: the last one holds, as when protobuf parses a map
      out.present = true;
      WireCursor fc(value.data, value.size, &where);
      WireField kind;
      while (next_wire_field(fc, kind, "tf.train.Feature")) {
        if (kind.wire != 2) continue;
        const bool want_float = id == kWeights;
        if (kind.number == 1)
          bad(place, kFeatureNames[id], "stored as a bytes_list, expected ",
              want_float ? "a float_list" : "an int64_list");
        if (kind.number == 2 && !want_float)
          bad(place, kFeatureNames[id], "stored as a float_list, expected an int64_list");
        if (kind.number == 3 && want_float)
          bad(place, kFeatureNames[id], "stored as an int64_list, expected a float_list");
        if (kind.number == 2 || kind.number == 3) {
          out.is_float = kind.number == 2;
          parse_list(kind, out.is_float, out, where);
        }
      }
    }
  }
}

}  // namespace

TfRecordSummary read_tfrecord_instances(const std::filesystem::path& path, const InstanceRules& rules,
                                        const std::function<void(Instance&&)>& sink) {
  NOPAD_CHECK(rules.vocab_size > 0, "TFRecord import of ", path.string(), ": vocabulary size must be positive");
  const MappedFile map(path);
  const std::string file = path.string();
  const uint8_t* p = map.data();
  const size_t n = map.size();
  NOPAD_CHECK(!(n >= 2 && p[0] == 0x1f && p[1] == 0x8b), "TFRecord file ", file,
              " is GZIP-compressed: decompress it first (e.g. gunzip), nopad reads uncompressed TFRecord files");
  TfRecordSummary summary;
  FeatureValues f[kNumFeatures];
  size_t off = 0;
  for (uint64_t record = 0; off < n; ++record) {
    const RecordPlace place{"TFRecord file", file, "feature", "record", record, -1, kHint};
    NOPAD_CHECK(n - off >= 12, "TFRecord file ", file, ": truncated record header at byte ", off, " (record ", record,
                ")");
    uint64_t len;
    uint32_t len_crc;
    std::memcpy(&len, p + off, 8);
    std::memcpy(&len_crc, p + off + 8, 4);
    NOPAD_CHECK(crc32c_unmask(len_crc) == crc32c(p + off, 8), "TFRecord file ", file, ": record ", record, " at byte ",
                off,
                ": the length does not match its checksum (not a TFRecord file, a compressed one, "
                "or corrupt)");
    NOPAD_CHECK(len <= n - off - 12 && n - off - 12 - len >= 4, "TFRecord file ", file, ": record ", record,
                " at byte ", off, " is truncated (", len, " bytes announced)");
    const uint8_t* data = p + off + 12;
    uint32_t data_crc;
    std::memcpy(&data_crc, data + len, 4);
    NOPAD_CHECK(crc32c_unmask(data_crc) == crc32c(data, len), "TFRecord file ", file, ": record ", record, " at byte ",
                off, " does not match its checksum (the file is corrupt)");
    off += 12 + len + 4;

    const std::string where = str_cat("TFRecord file ", file, ", record ", record);
    parse_example(data, len, place, where, f);
    for (int i = 0; i < kNumFeatures; ++i)
      if (i != kWeights && !f[i].present) bad(place, kFeatureNames[i], "missing");
    const std::vector<int32_t>&ids = f[kInputIds].ints, &mask = f[kInputMask].ints, &segs = f[kSegmentIds].ints,
          &pos = f[kPositions].ints, &lab = f[kLabels].ints;
    if (mask.size() != ids.size()) bad(place, "input_mask", mask.size(), " values but input_ids has ", ids.size());
    if (segs.size() != ids.size()) bad(place, "segment_ids", segs.size(), " values but input_ids has ", ids.size());
    size_t length = 0;
    while (length < mask.size() && mask[length] == 1) ++length;
    for (size_t j = length; j < mask.size(); ++j)
      if (mask[j] != 0)
        bad(place, "input_mask", "mask value ", mask[j], " at position ", j, " is not of the form 1..1 0..0");
    if (lab.size() != pos.size())
      bad(place, "masked_lm_ids", lab.size(), " values but masked_lm_positions has ", pos.size());
    const size_t k = unpadded_masked_count(place, pos);
    if (f[kWeights].present) {
      const std::vector<float>& w = f[kWeights].floats;
      if (w.size() != pos.size())
        bad(place, "masked_lm_weights", w.size(), " values but masked_lm_positions has ", pos.size());
      for (size_t j = 0; j < w.size(); ++j)
        if (w[j] != (j < k ? 1.0f : 0.0f))
          bad(place, "masked_lm_weights", "weight ", w[j], " at entry ", j, " does not match the ", k,
              " masked positions before the zero padding (expected 1.0 for each, then 0.0)");
    }
    if (f[kNsp].ints.size() != 1) bad(place, "next_sentence_labels", f[kNsp].ints.size(), " values, expected 1");
    Instance inst = make_checked_instance(place, std::span(ids).first(length), std::span(segs).first(length),
                                          std::span(pos).first(k), std::span(lab).first(k), f[kNsp].ints[0], 0, rules);
    ++summary.num_records;
    summary.num_tokens += inst.tokens.size();
    summary.num_masked += inst.mlm_positions.size();
    sink(std::move(inst));
  }
  return summary;
}

std::vector<Instance> read_tfrecord_file(const std::filesystem::path& path, const InstanceRules& rules,
                                         TfRecordSummary* summary) {
  std::vector<Instance> out;
  const TfRecordSummary s =
      read_tfrecord_instances(path, rules, [&](Instance&& inst) { out.push_back(std::move(inst)); });
  if (summary) *summary = s;
  return out;
}

}  // namespace nopad
