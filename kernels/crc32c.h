// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of every
// EncodedTensor and stored segment. Paths: folding with VPCLMULQDQ over
// 512-bit vectors (AVX-512 CPUs that have it) or 256-bit ones (AVX2 CPUs
// that have it), folding with PCLMULQDQ (below 12 KiB; the chains above),
// three chains of the SSE4.2 crc32 instruction, a slicing-by-8 table. The
// fastest this CPU has is timed once, at the first call;
// KVTIER_CRC32C=portable|sse42|pclmul|vpclmul256|vpclmul picks one (where
// the CPU has it), for comparisons.
#ifndef KVTIER_KERNELS_CRC32C_H_
#define KVTIER_KERNELS_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvtier {

// Continues a CRC: Crc32cExtend(Crc32cExtend(0, a), b) == Crc32c(a + b).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

inline uint32_t Crc32c(std::string_view s) { return Crc32cExtend(0, s.data(), s.size()); }

// The CRC of a + b from the CRCs of a and of b and b's length, without b's
// bytes: Crc32cCombine(Crc32c(a), Crc32c(b), b.size()) == Crc32c(a + b).
// It runs the CRC over len_b zero bytes, so it costs what extending over
// len_b bytes in cache costs: meant for short b (metadata whose CRC was
// kept), not for joining large blocks.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// The portable table version, exposed so tests can compare it with the
// hardware path.
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n);

// True when a hardware path is in use.
bool Crc32cHardware();

enum class Crc32cPath { kPortable, kSse42, kPclmul, kVpclmul, kVpclmul256 };

// "portable", "sse42", "pclmul", "vpclmul", "vpclmul256".
const char* Crc32cPathName(Crc32cPath path);
Crc32cPath Crc32cActivePath();
bool Crc32cPathAvailable(Crc32cPath path);
// Crc32cExtend through `path` (the portable table where the CPU lacks it);
// for tests and benchmarks.
uint32_t Crc32cExtendWith(Crc32cPath path, uint32_t crc, const void* data, size_t n);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_CRC32C_H_
