// CRC-32 (IEEE 802.3 polynomial, reflected; the same value as zlib.crc32 in Python), used for shard and checkpoint
// section checksums. crc32(data, n, previous) continues a running checksum.
#pragma once
#include <cstddef>
#include <cstdint>

namespace nopad {
uint32_t crc32(const void* data, size_t size_bytes, uint32_t previous = 0);
}
