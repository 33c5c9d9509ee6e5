// CRC-32 (IEEE 802.3 polynomial, reflected; the same value as zlib.crc32 in Python), used for shard and checkpoint
// section checksums. crc32(data, n, previous) continues a running checksum.
// CRC-32C (Castagnoli polynomial, reflected), the checksum of TensorFlow checkpoints and their LevelDB-format index;
// crc32c_unmask undoes the rotation TensorFlow stores it with.
#pragma once
#include <cstddef>
#include <cstdint>

namespace nopad {
uint32_t crc32(const void* data, size_t size_bytes, uint32_t previous = 0);
uint32_t crc32c(const void* data, size_t size_bytes, uint32_t previous = 0);
inline uint32_t crc32c_mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u; }
inline uint32_t crc32c_unmask(uint32_t masked) {
  const uint32_t rot = masked - 0xA282EAD8u;
  return (rot >> 17) | (rot << 15);
}
}
