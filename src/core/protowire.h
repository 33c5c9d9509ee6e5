// Reading the protocol-buffer wire format by hand: just what nopad needs to read other tools' files (TensorFlow's
// checkpoint index entries, tf.train.Example records) without a protobuf library. A WireCursor walks a byte range and
// throws "WHERE: truncated or corrupt (WHAT)" on any overrun; next_wire_field yields one field at a time (unknown
// fields are the caller's to skip: it simply ignores their numbers). Groups (wire types 3, 4) are refused.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "core/error.h"

namespace nopad {

class WireCursor {
 public:
  WireCursor(const uint8_t* begin, size_t size, const std::string* where)
      : p_(begin), end_(begin + size), where_(where) {}
  bool done() const { return p_ == end_; }
  size_t left() const { return static_cast<size_t>(end_ - p_); }
  const std::string& where() const { return *where_; }

  uint64_t varint(const char* what) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      NOPAD_CHECK(p_ < end_, *where_, ": truncated or corrupt (", what, ")");
      const uint8_t b = *p_++;
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    fail(*where_, ": corrupt varint (", what, ")");
  }
  const uint8_t* bytes(uint64_t n, const char* what) {
    NOPAD_CHECK(n <= left(), *where_, ": truncated or corrupt (", what, ")");
    const uint8_t* p = p_;
    p_ += n;
    return p;
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
  const std::string* where_;
};

struct WireField {
  uint32_t number = 0;
  uint32_t wire = 0;              // 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32
  uint64_t value = 0;             // varint and fixed fields
  const uint8_t* data = nullptr;  // length-delimited fields
  size_t size = 0;
};

// The next field of the message under `c`, or false at its end.
inline bool next_wire_field(WireCursor& c, WireField& f, const char* what) {
  if (c.done()) return false;
  const uint64_t tag = c.varint(what);
  f.number = static_cast<uint32_t>(tag >> 3);
  f.wire = static_cast<uint32_t>(tag & 7);
  switch (f.wire) {
    case 0:
      f.value = c.varint(what);
      break;
    case 1:
      std::memcpy(&f.value, c.bytes(8, what), 8);
      break;
    case 2:
      f.size = c.varint(what);
      f.data = c.bytes(f.size, what);
      break;
    case 5: {
      uint32_t v;
      std::memcpy(&v, c.bytes(4, what), 4);
      f.value = v;
      break;
    }
    default:
      fail(c.where(), ": unsupported protobuf wire type ", f.wire, " (", what, ")");
  }
  return true;
}

}  // namespace nopad
