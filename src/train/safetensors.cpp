// Reading and writing safetensors files (format and contracts in safetensors.h).
#include "train/safetensors.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"

namespace nopad {
namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};
constexpr std::array<DTypeInfo, 10> kDTypes{{{DType::kF64, "F64", 8},
                                             {DType::kF32, "F32", 4},
                                             {DType::kF16, "F16", 2},
                                             {DType::kBF16, "BF16", 2},
                                             {DType::kI64, "I64", 8},
                                             {DType::kI32, "I32", 4},
                                             {DType::kI16, "I16", 2},
                                             {DType::kI8, "I8", 1},
                                             {DType::kU8, "U8", 1},
                                             {DType::kBool, "BOOL", 1}}};

// A larger header is refused as the Python library refuses it: a corrupt length must not make us parse gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;


// numel of `shape` times `elem`, or false on overflow.
bool byte_size(const std::vector<int64_t>& shape, size_t elem, size_t* numel, size_t* bytes) {
  size_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d != 0 && n > std::numeric_limits<size_t>::max() / static_cast<size_t>(d)) return false;
    n *= static_cast<size_t>(d);
  }
  if (n != 0 && elem > std::numeric_limits<size_t>::max() / n) return false;
  *numel = n;
  *bytes = n * elem;
  return true;
}

std::string json_string(const std::string& s, const char* what) {
  try {
    return nlohmann::json(s).dump();
  } catch (const nlohmann::json::exception&) {
    fail("safetensors: ", what, " '", s, "' is not valid UTF-8");
  }
}

}  // namespace

size_t dtype_size(DType d) {
  for (const DTypeInfo& i : kDTypes)
    if (i.dtype == d) return i.size;
  fail("safetensors: unknown dtype value ", static_cast<int>(d));
}

std::string_view dtype_name(DType d) {
  for (const DTypeInfo& i : kDTypes)
    if (i.dtype == d) return i.name;
  fail("safetensors: unknown dtype value ", static_cast<int>(d));
}

DType dtype_from_name(std::string_view name) {
  for (const DTypeInfo& i : kDTypes)
    if (name == i.name) return i.dtype;
  fail("unsupported dtype '", name, "' (supported: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)");
}

// The 16-bit conversions are core/dtype.h's (round to nearest even, NaN kept); these wrappers take raw bits.
float half_to_float(uint16_t h) { return to_float(f16{h}); }
uint16_t float_to_half(float f) { return to_f16(f).bits; }
float bf16_to_float(uint16_t b) { return to_float(bf16{b}); }
uint16_t float_to_bf16(float f) { return to_bf16(f).bits; }

bool convert_to_float(DType dtype, const uint8_t* p, size_t numel, float* out) {
  switch (dtype) {  // the dtypes of is_float_dtype
    case DType::kF32:
      if (numel) std::memcpy(out, p, numel * 4);
      return true;
    case DType::kF16:
    case DType::kBF16:
      for (size_t i = 0; i < numel; ++i) {
        const uint16_t h = static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
        out[i] = dtype == DType::kF16 ? half_to_float(h) : bf16_to_float(h);
      }
      return true;
    case DType::kF64:
      for (size_t i = 0; i < numel; ++i) {
        double d;
        std::memcpy(&d, p + 8 * i, 8);
        out[i] = static_cast<float>(d);
      }
      return true;
    default:
      return false;
  }
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string safetensors_header(const std::vector<SafetensorsTensor>& tensors, const SafetensorsMetadata& metadata) {
  std::vector<const SafetensorsTensor*> order;
  for (const SafetensorsTensor& t : tensors) {
    NOPAD_CHECK(!t.name.empty(), "safetensors: a tensor has an empty name");
    NOPAD_CHECK(t.name != "__metadata__", "safetensors: '__metadata__' is reserved and cannot name a tensor");
    order.push_back(&t);
  }
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->name < b->name; });
  for (size_t i = 1; i < order.size(); ++i)
    NOPAD_CHECK(order[i]->name != order[i - 1]->name, "safetensors: tensor '", order[i]->name, "' is listed twice");

  std::string h = "{";
  bool first = true;
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    for (auto it = metadata.begin(); it != metadata.end(); ++it) {
      if (it != metadata.begin()) h += ',';
      h += json_string(it->first, "metadata key") + ':' + json_string(it->second, "metadata value");
    }
    h += '}';
    first = false;
  }
  size_t offset = 0;
  for (const SafetensorsTensor* t : order) {
    size_t numel = 0, bytes = 0;
    NOPAD_CHECK(byte_size(t->shape, dtype_size(t->dtype), &numel, &bytes), "safetensors: tensor '", t->name,
                "' has a negative or overflowing shape");
    NOPAD_CHECK(bytes == 0 || t->data != nullptr, "safetensors: tensor '", t->name, "' has no data");
    if (!first) h += ',';
    first = false;
    h += json_string(t->name, "tensor name");
    h += ":{\"dtype\":\"";
    h += dtype_name(t->dtype);
    h += "\",\"shape\":[";
    for (size_t i = 0; i < t->shape.size(); ++i) {
      if (i) h += ',';
      h += std::to_string(t->shape[i]);
    }
    h += "],\"data_offsets\":[" + std::to_string(offset) + ',' + std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  return h;
}

void write_safetensors(const fs::path& path, const std::vector<SafetensorsTensor>& tensors,
                       const SafetensorsMetadata& metadata) {
  std::string header;
  try {
    header = safetensors_header(tensors, metadata);
  } catch (const Error& e) {
    fail("cannot write ", path.string(), ": ", e.what());
  }
  std::vector<const SafetensorsTensor*> order;
  for (const SafetensorsTensor& t : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->name < b->name; });

  AtomicWriter w(path);
  uint8_t len[8];
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));  // little-endian on any host
  w.write(len, 8);
  w.write(header);
  for (const SafetensorsTensor* t : order) {
    size_t numel = 0, bytes = 0;
    byte_size(t->shape, dtype_size(t->dtype), &numel, &bytes);
    if (bytes) w.write(t->data, bytes);
  }
  w.commit();
}

SafetensorsFile::SafetensorsFile(const fs::path& path) : map_(path) {
  const std::string file = path.string();
  const size_t size = map_.size();
  NOPAD_CHECK(size >= 8, file, ": not a safetensors file (", size,
              " bytes, too short for the 8-byte header length); was it truncated?");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(map_.data()[i]) << (8 * i);
  NOPAD_CHECK(n <= size - 8, file, ": header length ", n, " runs past the end of the file (", size,
              " bytes); the file is truncated or not safetensors");
  NOPAD_CHECK(n <= kMaxHeaderBytes, file, ": header length ", n, " is larger than the 100 MiB limit; corrupt file?");
  data_ = map_.data() + 8 + n;
  data_size_ = size - 8 - n;

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(map_.data() + 8, map_.data() + 8 + n);
  } catch (const nlohmann::json::exception& e) {
    fail(file, ": the safetensors header is not valid JSON (", e.what(), "); the file is corrupt");
  }
  NOPAD_CHECK(header.is_object(), file, ": the safetensors header is not a JSON object");

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      NOPAD_CHECK(v.is_object(), file, ": __metadata__ is not an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        NOPAD_CHECK(m.value().is_string(), file, ": __metadata__ value for '", m.key(), "' is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = file + ": tensor '" + name + "'";
    NOPAD_CHECK(v.is_object(), where, ": entry is not an object");
    NOPAD_CHECK(v.contains("dtype") && v["dtype"].is_string(), where, ": missing or non-string \"dtype\"");
    SafetensorsEntry e;
    e.name = name;
    try {
      e.dtype = dtype_from_name(v["dtype"].get<std::string>());
    } catch (const Error& err) {
      fail(where, ": ", err.what());
    }
    NOPAD_CHECK(v.contains("shape") && v["shape"].is_array(), where, ": missing or non-array \"shape\"");
    for (const auto& d : v["shape"]) {
      NOPAD_CHECK(d.is_number_unsigned() && d.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX), where,
                  ": shape holds ", d.dump(), ", not a non-negative integer");
      e.shape.push_back(d.get<int64_t>());
    }
    const auto& off = v.contains("data_offsets") ? v["data_offsets"] : nlohmann::json();
    NOPAD_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                where, ": \"data_offsets\" must be [begin, end] with non-negative integers");
    const uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    NOPAD_CHECK(b <= en && en <= data_size_, where, ": data_offsets [", b, ", ", en,
                "] lie outside the data section (", data_size_, " bytes); the file is truncated or corrupt");
    e.begin = b;
    e.end = en;
    size_t bytes = 0;
    NOPAD_CHECK(byte_size(e.shape, dtype_size(e.dtype), &e.numel, &bytes), where, ": shape overflows");
    NOPAD_CHECK(bytes == en - b, where, ": ", en - b, " data bytes for ", e.numel, " elements of ",
                dtype_name(e.dtype), " (", bytes, " bytes expected)");
    entries_.push_back(std::move(e));
  }

  // Tensors must tile the data section exactly: no overlap, no gap, nothing after the last one.
  std::vector<const SafetensorsEntry*> by_offset;
  for (const SafetensorsEntry& e : entries_) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  size_t pos = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry* e : by_offset) {
    NOPAD_CHECK(e->begin >= pos, file, ": tensor '", e->name, "' overlaps tensor '", prev ? prev->name : "",
                "' in the data section; the file is corrupt");
    NOPAD_CHECK(e->begin == pos, file, ": ", e->begin - pos, " unused bytes before tensor '", e->name,
                "' in the data section; the file is corrupt");
    pos = e->end;
    prev = e;
  }
  NOPAD_CHECK(pos == data_size_, file, ": ", data_size_ - pos,
              " bytes after the last tensor belong to no tensor; the file is corrupt");
  std::sort(entries_.begin(), entries_.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  auto it = std::lower_bound(entries_.begin(), entries_.end(), name,
                             [](const SafetensorsEntry& e, std::string_view n) { return e.name < n; });
  return it != entries_.end() && it->name == name ? &*it : nullptr;
}

const SafetensorsEntry& SafetensorsFile::at(std::string_view name) const {
  const SafetensorsEntry* e = find(name);
  NOPAD_CHECK(e != nullptr, path().string(), ": no tensor '", name, "' (the file has ", entries_.size(),
              " tensors)");
  return *e;
}

std::span<const uint8_t> SafetensorsFile::bytes(const SafetensorsEntry& e) const {
  return {data_ + e.begin, e.end - e.begin};
}

void SafetensorsFile::read_float(std::string_view name, float* out, size_t out_numel) const {
  const SafetensorsEntry& e = at(name);
  NOPAD_CHECK(out_numel == e.numel, path().string(), ": tensor '", name, "' has ", e.numel, " elements, the caller expects ",
              out_numel);
  if (!convert_to_float(e.dtype, data_ + e.begin, e.numel, out))
    fail(path().string(), ": tensor '", name, "' has dtype ", dtype_name(e.dtype),
         ", not a floating-point type that converts to fp32");
}

std::vector<float> SafetensorsFile::read_float(std::string_view name) const {
  std::vector<float> out(at(name).numel);
  read_float(name, out.data(), out.size());
  return out;
}

}  // namespace nopad
