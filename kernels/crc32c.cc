#include "kernels/crc32c.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/x86_intrinsics.h"

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
// the chains are merged with precomputed zero-byte operators. Works on the
// raw (not inverted) register.
constexpr size_t kStripeBlock = 4096;

__attribute__((target("sse4.2"))) uint64_t RawHw(uint64_t c, const uint8_t* p, size_t n) {
  static const Gf2Matrix* const kShift1 = new Gf2Matrix(ZeroBytesOperator(kStripeBlock));
  static const Gf2Matrix* const kShift2 = new Gf2Matrix(ZeroBytesOperator(2 * kStripeBlock));
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
  return c;
}

uint32_t ExtendHw(uint32_t crc, const uint8_t* p, size_t n) {
  return ~static_cast<uint32_t>(RawHw(~crc, p, n));
}

// --- Folding with carry-less multiplication ---
//
// The message is a polynomial over GF(2); the CRC is its remainder (times
// x^32) modulo the Castagnoli polynomial P. A 128-bit block A that sits D
// bits before block B can be replaced by A_lo * (x^(D+32) mod P) +
// A_hi * (x^(D-32) mod P) added into B (in the reflected bit order the CRC
// uses, with one extra factor x for pclmulqdq's 127-bit product): the sum is
// congruent to A * x^D and fits in 128 bits. Folding every block into the
// last one leaves 16 bytes congruent to everything before them; the crc32
// instruction then reduces those and the tail. The constants are
// reflect32(x^e mod P) << 1 for the exponents named.
constexpr uint64_t kX96 = 0x14cd00bd6, kX160 = 0xf20c0dfe;    // D = 128
constexpr uint64_t kX224 = 0xba4fc28e, kX288 = 0x1384aa63a;   // D = 256
constexpr uint64_t kX352 = 0x1d82c63da, kX416 = 0x1c291d04;   // D = 384
constexpr uint64_t kX480 = 0x9e4addf8, kX544 = 0x740eef02;    // D = 512
constexpr uint64_t kX992 = 0xd3b6092, kX1056 = 0x6992cea2;    // D = 1024
constexpr uint64_t kX2016 = 0xb9e02b86, kX2080 = 0xdcb17aa4;  // D = 2048

// Inputs shorter than this keep the crc32 chains.
constexpr size_t kFoldMin = 256;

__attribute__((target("sse4.2,pclmul"))) inline __m128i Fold(__m128i x, __m128i k, __m128i next) {
  return _mm_xor_si128(
      _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

__attribute__((target("sse4.2,pclmul"))) inline __m128i Load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// The last 16 folded bytes, then the tail (under 16 bytes), through crc32.
__attribute__((target("sse4.2,pclmul"))) uint32_t Finish(__m128i x, const uint8_t* p, size_t n) {
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(x, 1)));
  return ~static_cast<uint32_t>(RawHw(c, p, n));
}

// Four 128-bit accumulators, 64 bytes per step (every CPU with PCLMULQDQ).
// One fold a cycle is slower than the three crc32 chains on long inputs
// (15 against 28 GB/s on a Zen 4) but faster below their 12 KiB stripes,
// so it takes only those.
__attribute__((target("sse4.2,pclmul"))) uint32_t ExtendPclmul(uint32_t crc, const uint8_t* p,
                                                               size_t n) {
  if (n < kFoldMin || n >= 3 * kStripeBlock) return ExtendHw(crc, p, n);
  __m128i x0 = _mm_xor_si128(Load16(p), _mm_cvtsi32_si128(static_cast<int>(~crc)));
  __m128i x1 = Load16(p + 16), x2 = Load16(p + 32), x3 = Load16(p + 48);
  p += 64;
  n -= 64;
  const __m128i k512 = _mm_set_epi64x(kX480, kX544);
  while (n >= 64) {
    x0 = Fold(x0, k512, Load16(p));
    x1 = Fold(x1, k512, Load16(p + 16));
    x2 = Fold(x2, k512, Load16(p + 32));
    x3 = Fold(x3, k512, Load16(p + 48));
    p += 64;
    n -= 64;
  }
  const __m128i k128 = _mm_set_epi64x(kX96, kX160);
  __m128i x = Fold(Fold(Fold(x0, k128, x1), k128, x2), k128, x3);
  while (n >= 16) {
    x = Fold(x, k128, Load16(p));
    p += 16;
    n -= 16;
  }
  return Finish(x, p, n);
}

#define KVT_VPCLMUL_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,sse4.2,pclmul")))

KVT_VPCLMUL_TARGET inline __m512i Fold512(__m512i x, __m512i k, __m512i next) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                   _mm512_clmulepi64_epi128(x, k, 0x11), next, 0x96);
}

KVT_VPCLMUL_TARGET inline __m512i Load64(const uint8_t* p) { return _mm512_loadu_si512(p); }

// Four 512-bit accumulators, 256 bytes per step (AVX-512 with VPCLMULQDQ:
// four products per instruction).
KVT_VPCLMUL_TARGET uint32_t ExtendVpclmul(uint32_t crc, const uint8_t* p, size_t n) {
  if (n < 1024) return ExtendPclmul(crc, p, n);
  __m512i z0 = _mm512_xor_si512(Load64(p),
                                _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(~crc))));
  __m512i z1 = Load64(p + 64), z2 = Load64(p + 128), z3 = Load64(p + 192);
  p += 256;
  n -= 256;
  const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(kX2016, kX2080));
  while (n >= 256) {
    z0 = Fold512(z0, k2048, Load64(p));
    z1 = Fold512(z1, k2048, Load64(p + 64));
    z2 = Fold512(z2, k2048, Load64(p + 128));
    z3 = Fold512(z3, k2048, Load64(p + 192));
    p += 256;
    n -= 256;
  }
  const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x(kX480, kX544));
  __m512i z = Fold512(Fold512(Fold512(z0, k512, z1), k512, z2), k512, z3);
  while (n >= 64) {
    z = Fold512(z, k512, Load64(p));
    p += 64;
    n -= 64;
  }
  // The four lanes into the last: lane j is 3 - j blocks before it.
  const __m512i lanes = _mm512_set_epi64(0, 0, kX96, kX160, kX224, kX288, kX352, kX416);
  const __m512i t = _mm512_xor_si512(_mm512_clmulepi64_epi128(z, lanes, 0x00),
                                     _mm512_clmulepi64_epi128(z, lanes, 0x11));
  const __m256i t2 = _mm256_xor_si256(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64(t, 1));
  __m128i x = _mm_xor_si128(_mm256_castsi256_si128(t2), _mm256_extracti128_si256(t2, 1));
  x = _mm_xor_si128(x, _mm512_extracti32x4_epi32(z, 3));
  const __m128i k128 = _mm_set_epi64x(kX96, kX160);
  while (n >= 16) {
    x = Fold(x, k128, Load16(p));
    p += 16;
    n -= 16;
  }
  return Finish(x, p, n);
}

#define KVT_VPCLMUL256_TARGET __attribute__((target("avx2,vpclmulqdq,sse4.2,pclmul")))

KVT_VPCLMUL256_TARGET inline __m256i Fold256(__m256i x, __m256i k, __m256i next) {
  return _mm256_xor_si256(
      _mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00), _mm256_clmulepi64_epi128(x, k, 0x11)),
      next);
}

KVT_VPCLMUL256_TARGET inline __m256i Load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Four 256-bit accumulators, 128 bytes per step (VPCLMULQDQ without
// AVX-512: Zen 3, Ice Lake client and later), two products per instruction.
KVT_VPCLMUL256_TARGET uint32_t ExtendVpclmul256(uint32_t crc, const uint8_t* p, size_t n) {
  if (n < 512) return ExtendPclmul(crc, p, n);
  __m256i y0 = _mm256_xor_si256(Load32(p),
                                _mm256_zextsi128_si256(_mm_cvtsi32_si128(static_cast<int>(~crc))));
  __m256i y1 = Load32(p + 32), y2 = Load32(p + 64), y3 = Load32(p + 96);
  p += 128;
  n -= 128;
  const __m256i k1024 = _mm256_broadcastsi128_si256(_mm_set_epi64x(kX992, kX1056));
  while (n >= 128) {
    y0 = Fold256(y0, k1024, Load32(p));
    y1 = Fold256(y1, k1024, Load32(p + 32));
    y2 = Fold256(y2, k1024, Load32(p + 64));
    y3 = Fold256(y3, k1024, Load32(p + 96));
    p += 128;
    n -= 128;
  }
  const __m256i k256 = _mm256_broadcastsi128_si256(_mm_set_epi64x(kX224, kX288));
  __m256i y = Fold256(Fold256(Fold256(y0, k256, y1), k256, y2), k256, y3);
  while (n >= 32) {
    y = Fold256(y, k256, Load32(p));
    p += 32;
    n -= 32;
  }
  const __m128i k128 = _mm_set_epi64x(kX96, kX160);
  __m128i x = Fold(_mm256_castsi256_si128(y), k128, _mm256_extracti128_si256(y, 1));
  while (n >= 16) {
    x = Fold(x, k128, Load16(p));
    p += 16;
    n -= 16;
  }
  return Finish(x, p, n);
}

bool DetectHw() { return __builtin_cpu_supports("sse4.2"); }
bool DetectPclmul() { return DetectHw() && __builtin_cpu_supports("pclmul"); }
bool DetectVpclmul() {
  return DetectPclmul() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq");
}
bool DetectVpclmul256() {
  return DetectPclmul() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq");
}
#else
uint32_t ExtendHw(uint32_t, const uint8_t*, size_t) { return 0; }
uint32_t ExtendPclmul(uint32_t, const uint8_t*, size_t) { return 0; }
uint32_t ExtendVpclmul(uint32_t, const uint8_t*, size_t) { return 0; }
bool DetectHw() { return false; }
bool DetectPclmul() { return false; }
bool DetectVpclmul() { return false; }
uint32_t ExtendVpclmul256(uint32_t, const uint8_t*, size_t) { return 0; }
bool DetectVpclmul256() { return false; }
#endif

bool Available(Crc32cPath path) {
  switch (path) {
    case Crc32cPath::kPortable:
      return true;
    case Crc32cPath::kSse42:
      return DetectHw();
    case Crc32cPath::kPclmul:
      return DetectPclmul();
    case Crc32cPath::kVpclmul:
      return DetectVpclmul();
    case Crc32cPath::kVpclmul256:
      return DetectVpclmul256();
  }
  return false;
}

constexpr Crc32cPath kAllPaths[] = {Crc32cPath::kPortable, Crc32cPath::kSse42, Crc32cPath::kPclmul,
                                    Crc32cPath::kVpclmul256, Crc32cPath::kVpclmul};

// KVTIER_CRC32C's path when this CPU has it; otherwise the fastest this CPU
// has, timed once on 64 KiB (best of 5 each, about 0.2 ms in all): which
// of the crc32 chains and the folds wins depends on the core (on a Zen 4,
// 512-bit folds 62 GB/s, the chains 28, 128-bit folds 15).
Crc32cPath ChoosePath() {
  if (const char* env = std::getenv("KVTIER_CRC32C"); env != nullptr) {
    for (Crc32cPath p : kAllPaths) {
      if (std::strcmp(env, Crc32cPathName(p)) == 0 && Available(p)) return p;
    }
  }
  std::vector<uint8_t> buf(64 << 10);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 131 + (i >> 8));
  Crc32cPath best = Crc32cPath::kPortable;
  double best_s = std::numeric_limits<double>::infinity();
  for (Crc32cPath p : kAllPaths) {
    if (p == Crc32cPath::kPortable || !Available(p)) continue;
    double t = std::numeric_limits<double>::infinity();
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      volatile uint32_t sink = Crc32cExtendWith(p, 0, buf.data(), buf.size());
      (void)sink;
      t = std::min(t, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    if (t < best_s) {
      best_s = t;
      best = p;
    }
  }
  return best;
}

Crc32cPath ActivePath() {
  static const Crc32cPath path = ChoosePath();
  return path;
}

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

bool Crc32cHardware() { return ActivePath() != Crc32cPath::kPortable; }

const char* Crc32cPathName(Crc32cPath path) {
  switch (path) {
    case Crc32cPath::kPortable:
      return "portable";
    case Crc32cPath::kSse42:
      return "sse42";
    case Crc32cPath::kPclmul:
      return "pclmul";
    case Crc32cPath::kVpclmul:
      return "vpclmul";
    case Crc32cPath::kVpclmul256:
      return "vpclmul256";
  }
  return "?";
}

Crc32cPath Crc32cActivePath() { return ActivePath(); }

bool Crc32cPathAvailable(Crc32cPath path) { return Available(path); }

namespace {

// `path` runs as asked: callers have checked that this CPU has it.
uint32_t Dispatch(Crc32cPath path, uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  switch (path) {
    case Crc32cPath::kVpclmul:
      return ExtendVpclmul(crc, p, n);
    case Crc32cPath::kVpclmul256:
      return ExtendVpclmul256(crc, p, n);
    case Crc32cPath::kPclmul:
      return ExtendPclmul(crc, p, n);
    case Crc32cPath::kSse42:
      return ExtendHw(crc, p, n);
    case Crc32cPath::kPortable:
      break;
  }
  return Crc32cExtendPortable(crc, data, n);
}

}  // namespace

uint32_t Crc32cExtendWith(Crc32cPath path, uint32_t crc, const void* data, size_t n) {
  return Dispatch(Available(path) ? path : Crc32cPath::kPortable, crc, data, n);
}

// ActivePath() was checked when it was chosen: no CPU feature tests per call.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  return Dispatch(ActivePath(), crc, data, n);
}

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  // Without its inversions the CRC is linear in its register: the register
  // after a + b is a's register run through len_b zero bytes, xor b's from
  // zero. Crc32cExtend inverts on the way in and out, so ~Extend(~crc_a,
  // zeros) is a's register run through the zeros, and the inversions of b's
  // own CRC cancel against those of its zero-started run.
  static constexpr uint8_t kZeros[256] = {};
  uint32_t reg = ~crc_a;
  while (len_b > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(len_b, sizeof(kZeros)));
    reg = Crc32cExtend(reg, kZeros, n);
    len_b -= n;
  }
  return ~reg ^ crc_b;
}

}  // namespace kvtier
