// The safetensors format: 8-byte little-endian header length N, N bytes of JSON header
//   {"__metadata__": {string: string}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...}
// padded with spaces to a multiple of 8, then the tensor bytes (offsets relative to the end of the header).
//
// Writer contract (what the Python/Rust library writes): compact JSON, "__metadata__" first (omitted when empty,
// keys sorted), tensors sorted by name, each entry's fields in the order dtype, shape, data_offsets, data laid out
// contiguously in the same order from offset 0, the file written atomically (temporary name, fsync, rename).
// Reader contract: memory-maps the file and validates everything before use (header length within the file,
// valid JSON object, known dtypes, non-negative shapes, offsets in bounds, size = numel * dtype size, tensors
// contiguous and non-overlapping and covering the data exactly), with errors naming the file and the tensor.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/io.h"

namespace nopad {

enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

size_t dtype_size(DType d);
std::string_view dtype_name(DType d);  // "F32", "BF16", ...
// Throws naming the supported dtypes when `name` is not one of them.
DType dtype_from_name(std::string_view name);

// IEEE half / bfloat16 <-> float (round to nearest even on the way down; NaN stays NaN).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);
// Converts numel little-endian values of a floating-point dtype (F32, F16, BF16, F64) at `bytes` to fp32 into out;
// returns false (writing nothing) for any other dtype. Shared by the safetensors and TensorFlow checkpoint readers.
bool convert_to_float(DType dtype, const uint8_t* bytes, size_t numel, float* out);
inline bool is_float_dtype(DType d) {
  return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16 || d == DType::kF64;
}
// "[30522, 1024]": a shape for messages.
std::string shape_str(const std::vector<int64_t>& shape);

// One tensor to write: `data` holds numel(shape) * dtype_size(dtype) bytes in little-endian order.
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

using SafetensorsMetadata = std::map<std::string, std::string>;

// The padded header (without the 8-byte length) exactly as the writer emits it. Throws on duplicate or empty
// names, a name "__metadata__", or a negative dimension.
std::string safetensors_header(const std::vector<SafetensorsTensor>& tensors, const SafetensorsMetadata& metadata);
void write_safetensors(const fs::path& path, const std::vector<SafetensorsTensor>& tensors,
                       const SafetensorsMetadata& metadata = {});

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  size_t numel = 0;
  size_t begin = 0, end = 0;  // byte offsets relative to the data section
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const fs::path& path);

  const fs::path& path() const { return map_.path(); }
  const std::vector<SafetensorsEntry>& tensors() const { return entries_; }  // sorted by name
  const SafetensorsMetadata& metadata() const { return metadata_; }
  const SafetensorsEntry* find(std::string_view name) const;
  // Throws "FILE: no tensor 'NAME'" when absent.
  const SafetensorsEntry& at(std::string_view name) const;
  // The tensor's raw bytes, pointing into the map (no alignment promised).
  std::span<const uint8_t> bytes(const SafetensorsEntry& e) const;
  // Converts an F32, F16 or BF16 tensor (F64 too) to fp32 into out[0, numel); throws when out_numel differs or
  // the dtype is not a float type.
  void read_float(std::string_view name, float* out, size_t out_numel) const;
  std::vector<float> read_float(std::string_view name) const;

 private:
  MappedFile map_;
  const uint8_t* data_ = nullptr;  // start of the data section
  size_t data_size_ = 0;
  std::vector<SafetensorsEntry> entries_;
  SafetensorsMetadata metadata_;
};

}  // namespace nopad
