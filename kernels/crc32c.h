// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of every
// EncodedTensor and stored segment. Uses the SSE4.2 crc32 instruction when
// the CPU has it (checked at run time) and a slicing-by-8 table otherwise.
#ifndef KVTIER_KERNELS_CRC32C_H_
#define KVTIER_KERNELS_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvtier {

// Continues a CRC: Crc32cExtend(Crc32cExtend(0, a), b) == Crc32c(a + b).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

inline uint32_t Crc32c(std::string_view s) { return Crc32cExtend(0, s.data(), s.size()); }

// The portable table version, exposed so tests can compare it with the
// hardware path.
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n);

// True when the hardware path is in use.
bool Crc32cHardware();

}  // namespace kvtier

#endif  // KVTIER_KERNELS_CRC32C_H_
