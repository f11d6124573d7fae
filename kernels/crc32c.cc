#include "kernels/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace kvtier {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t;
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (int s = 1; s < 8; ++s) {
      for (uint32_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    }
  }
};

const Tables& GetTables() {
  static const Tables* tables = new Tables();
  return *tables;
}

// Appending zero bytes to a raw CRC register is linear over GF(2): a 32x32
// bit matrix (one uint32 column per input bit). ZeroBytesOperator(n) is the
// matrix for n zero bytes, built by repeated squaring.
struct Gf2Matrix {
  uint32_t col[32];
  uint32_t Times(uint32_t v) const {
    uint32_t sum = 0;
    for (int i = 0; v != 0; ++i, v >>= 1) sum ^= (v & 1) ? col[i] : 0;
    return sum;
  }
  Gf2Matrix Squared() const {
    Gf2Matrix m;
    for (int i = 0; i < 32; ++i) m.col[i] = Times(col[i]);
    return m;
  }
};

Gf2Matrix ZeroBytesOperator(size_t n) {
  Gf2Matrix one_bit;  // Shifting the register by one zero bit.
  one_bit.col[0] = kPoly;
  for (int i = 1; i < 32; ++i) one_bit.col[i] = 1u << (i - 1);
  Gf2Matrix byte = one_bit.Squared().Squared().Squared();  // 8 bits.
  Gf2Matrix result;
  for (int i = 0; i < 32; ++i) result.col[i] = 1u << i;  // Identity.
  for (Gf2Matrix p = byte; n != 0; n >>= 1, p = p.Squared()) {
    if (n & 1) {
      Gf2Matrix r;
      for (int i = 0; i < 32; ++i) r.col[i] = p.Times(result.col[i]);
      result = r;
    }
  }
  return result;
}

#if defined(__x86_64__)
// Three independent crc32 chains hide the instruction's 3-cycle latency;
// the chains are merged with precomputed zero-byte operators.
constexpr size_t kStripeBlock = 4096;

__attribute__((target("sse4.2"))) uint32_t ExtendHw(uint32_t crc, const uint8_t* p, size_t n) {
  static const Gf2Matrix* const kShift1 = new Gf2Matrix(ZeroBytesOperator(kStripeBlock));
  static const Gf2Matrix* const kShift2 = new Gf2Matrix(ZeroBytesOperator(2 * kStripeBlock));
  uint64_t c = ~crc;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  while (n >= 3 * kStripeBlock) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t* p1 = p + kStripeBlock;
    const uint8_t* p2 = p + 2 * kStripeBlock;
    for (size_t i = 0; i < kStripeBlock; i += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p1 + i, 8);
      std::memcpy(&w2, p2 + i, 8);
      c = _mm_crc32_u64(c, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    c = kShift2->Times(static_cast<uint32_t>(c)) ^ kShift1->Times(static_cast<uint32_t>(c1)) ^
        static_cast<uint32_t>(c2);
    p += 3 * kStripeBlock;
    n -= 3 * kStripeBlock;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  return ~static_cast<uint32_t>(c);
}

bool DetectHw() { return __builtin_cpu_supports("sse4.2"); }
#else
uint32_t ExtendHw(uint32_t crc, const uint8_t* p, size_t n) { return 0; }
bool DetectHw() { return false; }
#endif

}  // namespace

uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n) {
  const auto& t = GetTables().t;
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
        t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return ~c;
}

bool Crc32cHardware() {
  static const bool hw = DetectHw();
  return hw;
}

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  if (Crc32cHardware()) return ExtendHw(crc, static_cast<const uint8_t*>(data), n);
  return Crc32cExtendPortable(crc, data, n);
}

}  // namespace kvtier
