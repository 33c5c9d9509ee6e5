// TensorFlow checkpoint reading (see tf_checkpoint.h): the LevelDB-format index table, the bundle's protobuf
// entries, the data shards, and the BERT name mapping.
#include "train/tf_checkpoint.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <set>
#include <sstream>

#include "core/crc32.h"
#include "core/error.h"
#include "core/protowire.h"

namespace nopad {
namespace {

constexpr uint64_t kTableMagic = 0xdb4775248b80fb57ull;  // LevelDB's table magic, as TensorFlow's table writes it
constexpr size_t kFooterSize = 48;                       // two block handles padded to 40 bytes, then the magic
constexpr size_t kBlockTrailerSize = 5;                  // compression type byte + masked CRC-32C

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;  // little-endian hosts only (checked below)
}

// TensorFlow's DataType enum (types.proto): its name, and nopad's DType where there is one.
struct TfDtype {
  int code;
  const char* name;
  bool known;
  DType dtype;
};
constexpr TfDtype kTfDtypes[] = {
    {1, "float32", true, DType::kF32},    {2, "float64", true, DType::kF64},  {3, "int32", true, DType::kI32},
    {4, "uint8", true, DType::kU8},       {5, "int16", true, DType::kI16},    {6, "int8", true, DType::kI8},
    {7, "string", false, DType::kU8},     {9, "int64", true, DType::kI64},    {10, "bool", true, DType::kBool},
    {14, "bfloat16", true, DType::kBF16}, {19, "float16", true, DType::kF16}, {20, "resource", false, DType::kU8},
    {21, "variant", false, DType::kU8},
};

const TfDtype* find_dtype(int code) {
  for (const TfDtype& d : kTfDtypes)
    if (d.code == code) return &d;
  return nullptr;
}

bool dtype_of(int tf_dtype, DType& out) {
  const TfDtype* d = find_dtype(tf_dtype);
  if (d == nullptr || !d->known) return false;
  out = d->dtype;
  return true;
}

std::string tf_dtype_name(int tf_dtype) {
  const TfDtype* d = find_dtype(tf_dtype);
  return d ? d->name : "DataType " + std::to_string(tf_dtype);
}

// TensorShapeProto: repeated Dim dim = 2 (Dim: int64 size = 1), bool unknown_rank = 3.
std::vector<int64_t> parse_shape(const uint8_t* data, size_t size, const std::string& where, const std::string& name) {
  std::vector<int64_t> shape;
  WireCursor c(data, size, &where);
  WireField f;
  while (next_wire_field(c, f, "tensor shape")) {
    if (f.number == 3 && f.wire == 0 && f.value != 0) fail(where, ": tensor ", name, " has an unknown rank");
    if (f.number != 2 || f.wire != 2) continue;
    WireCursor d(f.data, f.size, &where);
    WireField g;
    int64_t dim = 0;
    while (next_wire_field(d, g, "tensor shape dimension"))
      if (g.number == 1 && g.wire == 0) dim = static_cast<int64_t>(g.value);
    NOPAD_CHECK(dim >= 0, where, ": tensor ", name, " has a negative or unknown dimension (", dim, ")");
    shape.push_back(dim);
  }
  return shape;
}

// One block of the table, checksum verified; returns its contents without the trailer.
std::pair<const uint8_t*, size_t> read_block(const MappedFile& file, uint64_t offset, uint64_t size,
                                             const std::string& where, const char* what) {
  NOPAD_CHECK(offset <= file.size() && size <= file.size() - offset && kBlockTrailerSize <= file.size() - offset - size,
              where, ": truncated or corrupt (the ", what, " block at byte ", offset,
              " runs past the end of the file)");
  const uint8_t* p = file.data() + offset;
  const uint8_t type = p[size];
  const uint32_t stored = load_u32(p + size + 1);
  NOPAD_CHECK(crc32c_unmask(stored) == crc32c(p, size + 1), where, ": the ", what, " block at byte ", offset,
              " does not match its checksum (the file is corrupt)");
  NOPAD_CHECK(type == 0, where, ": the ", what, " block at byte ", offset, " is ",
              type == 1 ? "snappy-compressed" : "compressed", " (type ", static_cast<int>(type),
              "); nopad reads uncompressed index tables, which TensorFlow writes since 1.2: load and save the "
              "checkpoint again with a newer TensorFlow");
  return {p, size};
}

// Calls fn(key, value_ptr, value_size) for each entry of a table block, keys rebuilt from their shared prefixes.
template <class Fn>
void for_each_entry(const uint8_t* block, size_t size, const std::string& where, Fn&& fn) {
  NOPAD_CHECK(size >= 4, where, ": corrupt table block (", size, " bytes)");
  const uint32_t num_restarts = load_u32(block + size - 4);
  NOPAD_CHECK(num_restarts <= (size - 4) / 4, where, ": corrupt table block (", num_restarts, " restart points)");
  const size_t entries_end = size - 4 - 4 * static_cast<size_t>(num_restarts);
  WireCursor c(block, entries_end, &where);
  std::string key;
  while (!c.done()) {
    const uint64_t shared = c.varint("table entry");
    const uint64_t non_shared = c.varint("table entry");
    const uint64_t value_size = c.varint("table entry");
    NOPAD_CHECK(shared <= key.size(), where, ": corrupt table entry (shares ", shared, " bytes of a ", key.size(),
                "-byte key)");
    key.resize(shared);
    const uint8_t* k = c.bytes(non_shared, "table key");
    key.append(reinterpret_cast<const char*>(k), non_shared);
    const uint8_t* v = c.bytes(value_size, "table value");
    fn(key, v, static_cast<size_t>(value_size));
  }
}

// A TensorFlow `checkpoint` state file: model_checkpoint_path: "PATH" (relative to the folder, or absolute).
fs::path checkpoint_from_state_file(const fs::path& dir) {
  const std::string where = (dir / "checkpoint").string();
  std::istringstream text(read_file(dir / "checkpoint"));
  const std::string key = "model_checkpoint_path:";
  std::string line;
  bool found = false;
  while (!found && std::getline(text, line)) {
    line.erase(0, line.find_first_not_of(" \t"));
    found = line.compare(0, key.size(), key) == 0;
  }
  NOPAD_CHECK(found, where, ": no model_checkpoint_path line");
  const size_t q1 = line.find('"', key.size());
  const size_t q2 = q1 == std::string::npos ? q1 : line.find('"', q1 + 1);
  NOPAD_CHECK(q2 != std::string::npos, where, ": model_checkpoint_path is not a quoted path");
  fs::path p = line.substr(q1 + 1, q2 - q1 - 1);
  std::error_code ec;
  if (p.is_relative()) p = dir / p;
  // A folder copied from elsewhere keeps the absolute path it was written under: fall back to the name here.
  if (!fs::exists(fs::path(p.string() + ".index"), ec)) p = dir / p.filename();
  return p;
}

}  // namespace

fs::path resolve_tf_checkpoint(const fs::path& path) {
  std::error_code ec;
  if (path.extension() == ".index" && fs::is_regular_file(path, ec)) return fs::path(path).replace_extension();
  if (fs::is_regular_file(fs::path(path.string() + ".index"), ec)) return path;
  if (fs::is_directory(path, ec)) {
    if (fs::is_regular_file(path / "checkpoint", ec)) return checkpoint_from_state_file(path);
    std::vector<fs::path> found;
    for (const auto& e : fs::directory_iterator(path, ec))
      if (e.path().extension() == ".index") found.push_back(e.path());
    if (found.size() == 1) return found[0].replace_extension();
  }
  return {};
}

fs::path TfCheckpoint::index_path() const { return fs::path(prefix_.string() + ".index"); }

fs::path TfCheckpoint::data_path(int32_t shard) const {
  char suffix[64];
  std::snprintf(suffix, sizeof suffix, ".data-%05d-of-%05d", shard, num_shards());
  return fs::path(prefix_.string() + suffix);
}

TfCheckpoint::TfCheckpoint(const fs::path& path) {
  static_assert(std::endian::native == std::endian::little, "the checkpoint reader assumes a little-endian host");
  prefix_ = resolve_tf_checkpoint(path);
  NOPAD_CHECK(!prefix_.empty(), "TensorFlow checkpoint ", path.string(),
              ": not found (give the prefix, e.g. .../model.ckpt-28252 beside model.ckpt-28252.index, the .index "
              "file, or a folder with a `checkpoint` file or one .index file)");
  const std::string where = index_path().string();
  const MappedFile index(index_path());
  NOPAD_CHECK(index.size() >= kFooterSize, where, ": too short for a checkpoint index (", index.size(), " bytes)");
  const uint8_t* footer = index.data() + index.size() - kFooterSize;
  uint64_t magic;
  std::memcpy(&magic, footer + kFooterSize - 8, 8);
  NOPAD_CHECK(magic == kTableMagic, where, ": not a TensorFlow checkpoint index (no table magic at its end)");
  WireCursor fc(footer, kFooterSize - 8, &where);
  fc.varint("footer");  // metaindex block: filter and stats blocks, which TensorFlow's bundles do not use
  fc.varint("footer");
  const uint64_t index_offset = fc.varint("footer"), index_size = fc.varint("footer");

  bool have_header = false;
  int64_t num_shards = 0;
  const auto [iblock, isize] = read_block(index, index_offset, index_size, where, "index");
  for_each_entry(iblock, isize, where, [&](const std::string&, const uint8_t* handle, size_t handle_size) {
    WireCursor hc(handle, handle_size, &where);
    const uint64_t off = hc.varint("block handle"), size = hc.varint("block handle");
    const auto [block, bsize] = read_block(index, off, size, where, "data");
    for_each_entry(block, bsize, where, [&](const std::string& key, const uint8_t* v, size_t vsize) {
      WireCursor c(v, vsize, &where);
      WireField f;
      if (key.empty()) {  // BundleHeaderProto: num_shards = 1, endianness = 2, VersionDef version = 3
        have_header = true;
        while (next_wire_field(c, f, "checkpoint header")) {
          if (f.number == 1 && f.wire == 0) num_shards = static_cast<int64_t>(f.value);
          if (f.number == 2 && f.wire == 0)
            NOPAD_CHECK(f.value == 0, where, ": a big-endian checkpoint; nopad reads little-endian ones");
          if (f.number == 3 && f.wire == 2) {  // VersionDef: producer = 1, min_consumer = 2
            WireCursor vc(f.data, f.size, &where);
            WireField g;
            while (next_wire_field(vc, g, "checkpoint version"))
              if (g.number == 2 && g.wire == 0)
                NOPAD_CHECK(g.value <= 1, where, ": written in bundle format version ", g.value,
                            ", newer than the version 1 nopad reads");
          }
        }
        return;
      }
      // BundleEntryProto: dtype = 1, shape = 2, shard_id = 3, offset = 4, size = 5, crc32c = 6 (fixed32),
      // slices = 7.
      TfTensorEntry e;
      e.name = key;
      while (next_wire_field(c, f, "checkpoint entry")) {
        switch (f.number) {
          case 1:
            e.tf_dtype = static_cast<int>(f.value);
            break;
          case 2:
            e.shape = parse_shape(f.data, f.size, where, key);  // absent for a scalar
            break;
          case 3:
            e.shard = static_cast<int32_t>(f.value);
            break;
          case 4:
            e.offset = f.value;
            break;
          case 5:
            e.size = f.value;
            break;
          case 6:
            e.masked_crc32c = static_cast<uint32_t>(f.value);
            break;
          case 7:
            e.sliced = true;
            break;
          default:
            break;
        }
      }
      e.numel = 1;
      bool overflow = false;
      for (int64_t d : e.shape) overflow |= __builtin_mul_overflow(e.numel, static_cast<size_t>(d), &e.numel);
      NOPAD_CHECK(!overflow, where, ": tensor ", key, " has shape ", shape_str(e.shape),
                  ", more elements than fit in memory (the index is corrupt)");
      e.known_dtype = dtype_of(e.tf_dtype, e.dtype);
      NOPAD_CHECK(entries_.empty() || entries_.back().name < key, where, ": tensor names out of order at ", key,
                  " (the index is corrupt)");
      entries_.push_back(std::move(e));
    });
  });
  NOPAD_CHECK(have_header, where, ": no checkpoint header entry (not a tensor bundle index?)");
  NOPAD_CHECK(num_shards >= 1 && num_shards <= 100000, where, ": the header names ", num_shards, " data shards");

  shards_.resize(static_cast<size_t>(num_shards));
  for (int32_t s = 0; s < num_shards; ++s) {
    const fs::path p = data_path(s);
    std::error_code ec;
    NOPAD_CHECK(fs::is_regular_file(p, ec), "TensorFlow checkpoint ", prefix_.string(), ": data file ", p.string(),
                " is missing (the index names ", num_shards, " data shard", num_shards > 1 ? "s" : "", ")");
    shards_[static_cast<size_t>(s)] = std::make_unique<MappedFile>(p);
  }
  for (const TfTensorEntry& e : entries_) {
    if (e.sliced) continue;
    NOPAD_CHECK(e.shard >= 0 && e.shard < num_shards, where, ": tensor ", e.name, " names data shard ", e.shard, " of ",
                num_shards);
    const MappedFile& data = *shards_[static_cast<size_t>(e.shard)];
    NOPAD_CHECK(e.offset <= data.size() && e.size <= data.size() - e.offset, data.path().string(), ": tensor ", e.name,
                " (bytes ", e.offset, "..", e.offset + e.size, ") runs past the end of the file (", data.size(),
                " bytes): the data file is truncated or belongs to another index");
    // numel <= size / width first: a huge numel must not wrap the product around to the stored size.
    if (e.known_dtype)
      NOPAD_CHECK(e.numel <= e.size / dtype_size(e.dtype) && e.size == e.numel * dtype_size(e.dtype), where, ": tensor ", e.name, " of shape ", shape_str(e.shape),
                  " and dtype ", tf_dtype_name(e.tf_dtype), " is stored in ", e.size, " bytes");
  }
}

const TfTensorEntry* TfCheckpoint::find(std::string_view name) const {
  const auto it = std::lower_bound(entries_.begin(), entries_.end(), name,
                                   [](const TfTensorEntry& e, std::string_view n) { return e.name < n; });
  return it != entries_.end() && it->name == name ? &*it : nullptr;
}

const TfTensorEntry& TfCheckpoint::at(std::string_view name) const {
  const TfTensorEntry* e = find(name);
  NOPAD_CHECK(e != nullptr, "TensorFlow checkpoint ", prefix_.string(), ": no tensor ", name);
  return *e;
}

void TfCheckpoint::read_float(std::string_view name, float* out, size_t out_numel) const {
  const TfTensorEntry& e = at(name);
  const std::string where = "TensorFlow checkpoint " + prefix_.string() + ": tensor " + e.name;
  NOPAD_CHECK(!e.sliced, where, " is saved as slices of a partitioned variable, which nopad does not read");
  NOPAD_CHECK(e.known_dtype && is_float_dtype(e.dtype), where, " is ", tf_dtype_name(e.tf_dtype),
              ", not a floating-point tensor");
  NOPAD_CHECK(out_numel == e.numel, where, " has ", e.numel, " elements, ", out_numel, " were asked for");
  const MappedFile& data = *shards_[static_cast<size_t>(e.shard)];
  const uint8_t* p = data.data() + e.offset;
  NOPAD_CHECK(crc32c_unmask(e.masked_crc32c) == crc32c(p, e.size), where, " in ", data.path().string(),
              " does not match its checksum: the data file is corrupt or does not belong to this index");
  convert_to_float(e.dtype, p, e.numel, out);
}

std::vector<float> TfCheckpoint::read_float(std::string_view name) const {
  std::vector<float> out(at(name).numel);
  read_float(name, out.data(), out.size());
  return out;
}

TfVariableName tf_variable_for(const std::string& hf_name) {
  auto ends_with = [&](std::string_view s) {
    return hf_name.size() >= s.size() && hf_name.compare(hf_name.size() - s.size(), s.size(), s) == 0;
  };
  std::string base;
  std::string leaf;
  bool transposed = false;
  if (hf_name == "cls.predictions.bias") return {"cls/predictions/output_bias", false};
  if (hf_name == "cls.seq_relationship.weight") return {"cls/seq_relationship/output_weights", false};
  if (hf_name == "cls.seq_relationship.bias") return {"cls/seq_relationship/output_bias", false};
  if (ends_with("_embeddings.weight")) {
    base = hf_name.substr(0, hf_name.size() - 7);  // the embedding table is the variable itself
  } else if (ends_with(".LayerNorm.weight") || ends_with(".LayerNorm.bias")) {
    const bool weight = ends_with(".weight");
    base = hf_name.substr(0, hf_name.size() - (weight ? 7 : 5));
    leaf = weight ? "gamma" : "beta";
  } else if (ends_with(".weight")) {
    base = hf_name.substr(0, hf_name.size() - 7);
    leaf = "kernel";
    transposed = true;
  } else if (ends_with(".bias")) {
    base = hf_name.substr(0, hf_name.size() - 5);
    leaf = "bias";
  } else {
    fail("no TensorFlow name for parameter ", hf_name);
  }
  std::string tf;
  for (size_t i = 0; i < base.size(); ++i) {
    // "encoder.layer.7." -> "encoder/layer_7/"
    if (base.compare(i, 7, ".layer.") == 0 && i + 7 < base.size() &&
        std::isdigit(static_cast<unsigned char>(base[i + 7]))) {
      tf += "/layer_";
      i += 6;
      continue;
    }
    tf += base[i] == '.' ? '/' : base[i];
  }
  if (!leaf.empty()) tf += "/" + leaf;
  return {tf, transposed};
}

std::string TfImportReport::summary() const {
  std::string s = std::to_string(loaded) + " tensors loaded";
  if (optimizer_slots) s += ", " + std::to_string(optimizer_slots) + " optimizer slots left out";
  if (!ignored.empty()) {
    s += ", " + std::to_string(ignored.size()) + " other tensor" + (ignored.size() > 1 ? "s" : "") + " left out (";
    for (size_t i = 0; i < ignored.size() && i < 4; ++i) s += (i ? ", " : "") + ignored[i];
    s += ignored.size() > 4 ? ", ...)" : ")";
  }
  return s;
}

TfImportReport load_tf_bert_weights(const fs::path& path, const ParamLayout& layout, float* params) {
  const TfCheckpoint ck(path);
  const std::string where = "TensorFlow checkpoint " + ck.prefix().string();
  TfImportReport report;
  std::set<std::string> used;
  std::vector<float> buf;
  for (const ParamTensor& t : layout.tensors()) {
    const TfVariableName v = tf_variable_for(t.name);
    const TfTensorEntry* e = ck.find(v.name);
    if (e == nullptr && ck.find("_CHECKPOINTABLE_OBJECT_GRAPH") != nullptr)
      fail(where, ": variable ", v.name,
           " is missing: this is an object-based checkpoint (tf.train.Checkpoint, "
           "Keras), whose names follow the Python objects; nopad reads the name-based checkpoints of "
           "google-research/bert and MLPerf (tf.compat.v1.train.Saver)");
    NOPAD_CHECK(e != nullptr, where, ": variable ", v.name, " (", t.name, ") is missing",
                t.name.rfind("cls.", 0) == 0 ? " (a checkpoint without the pre-training heads cannot start "
                                               "pre-training)"
                                             : "");
    std::vector<int64_t> want = t.shape;
    if (v.transposed) std::reverse(want.begin(), want.end());
    NOPAD_CHECK(e->shape == want, where, ": variable ", v.name, " has shape ", shape_str(e->shape),
                ", the model (model.config) expects ", shape_str(want),
                v.transposed ? " (TensorFlow kernels are stored [in, out])" : "");
    float* dst = params + t.offset;
    if (!v.transposed) {
      ck.read_float(v.name, dst, t.numel);
    } else {
      buf.resize(t.numel);
      ck.read_float(v.name, buf.data(), t.numel);
      const size_t rows = static_cast<size_t>(t.shape[0]), cols = static_cast<size_t>(t.shape[1]);
      for (size_t r = 0; r < rows; ++r)  // stored [cols][rows]
        for (size_t c = 0; c < cols; ++c) dst[r * cols + c] = buf[c * rows + r];
    }
    used.insert(v.name);
    ++report.loaded;
  }
  for (const TfTensorEntry& e : ck.tensors()) {
    if (used.count(e.name)) continue;
    // An optimizer's slot of a model variable: "<variable>/adam_m", "<variable>/LAMB/m", ...
    bool slot = false;
    for (size_t slash = e.name.rfind('/'); slash != std::string::npos && slash > 0 && !slot;
         slash = e.name.rfind('/', slash - 1))
      slot = used.count(e.name.substr(0, slash)) > 0;
    if (slot) {
      ++report.optimizer_slots;
      continue;
    }
    NOPAD_CHECK(e.name.rfind("bert/", 0) != 0 && e.name.rfind("cls/", 0) != 0, where, ": variable ", e.name,
                " is not a parameter of the model in model.config (another architecture, or more layers than "
                "num_hidden_layers?)");
    report.ignored.push_back(e.name);
  }
  return report;
}

}  // namespace nopad
