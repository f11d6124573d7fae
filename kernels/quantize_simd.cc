// The vectorized codec kernels (AVX2+FMA+F16C+BMI2; kernels/simd_avx2.h):
// quantize a slab, dequantize rows, find out-of-range inputs, widen
// fp16/bf16, and the two BLAS-1 helpers the codecs use.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/simd_avx2.h"

namespace kvtier::internal {

namespace {

// The quantizer over input elements of `kIn` (fp32, or fp16/bf16 read
// directly, without a widened copy).
template <DType kIn>
void QuantizeSlab(const QuantShape& q, const void* x, uint8_t* codes, uint16_t* scales,
                  uint16_t* zeros, uint32_t* max_abs_bits) {
  const int d = q.d;
  auto load = [x](int64_t i) { return LoadElems8(kIn, x, i); };
  // |x| as integer bits, the largest per lane (see FirstOutOfRangeSimd).
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  __m256i amax = _mm256_setzero_si256();
  const bool tracking = max_abs_bits != nullptr;
  auto track = [&](__m256 v) {
    if (tracking) amax = _mm256_max_epu32(amax, _mm256_and_si256(_mm256_castps_si256(v), abs_mask));
  };
  auto report = [&] {
    if (max_abs_bits == nullptr) return;
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), amax);
    for (uint32_t l : lanes) *max_abs_bits = std::max(*max_abs_bits, l);
  };
  const float qmaxf = static_cast<float>((1 << q.bits) - 1);
  const __m256 qmax = _mm256_set1_ps(qmaxf);
  if (q.key) {
    std::vector<float> inv(d), zf(d);
    const int64_t groups = (q.tq + q.group - 1) / q.group;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t t0 = g * q.group;
      const int64_t n = std::min<int64_t>(q.group, q.tq - t0);
      // The next group's rows, a cache line per row every 64 bytes of
      // channels: this pass reads the group column by column, which the
      // hardware prefetcher does not follow far enough ahead.
      const int64_t ahead = std::min<int64_t>(q.group, q.tq - t0 - n);
      const auto* bytes = static_cast<const char*>(x);
      constexpr int kElem = kIn == DType::kFp32 ? 4 : 2;
      for (int c = 0; c < d; c += 8) {
        if ((c * kElem) % 64 == 0) {
          for (int64_t j = 0; j < ahead; ++j) {
            _mm_prefetch(bytes + ((t0 + n + j) * d + c) * kElem, _MM_HINT_T0);
          }
        }
        __m256 mn = load(t0 * d + c), mx = mn;
        track(mn);
        for (int64_t j = 1; j < n; ++j) {
          const __m256 v = load((t0 + j) * d + c);
          track(v);
          mn = _mm256_min_ps(mn, v);
          mx = _mm256_max_ps(mx, v);
        }
        const __m128i s16 = _mm256_cvtps_ph(_mm256_div_ps(_mm256_sub_ps(mx, mn), qmax), 0);
        const __m128i z16 = _mm256_cvtps_ph(mn, 0);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(scales + g * d + c), s16);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(zeros + g * d + c), z16);
        _mm256_storeu_ps(inv.data() + c, InvScale(_mm256_cvtph_ps(s16)));
        _mm256_storeu_ps(zf.data() + c, _mm256_cvtph_ps(z16));
      }
      for (int64_t t = t0; t < t0 + n; ++t) {
        const int64_t row = t * d;
        int c = 0;
        if (q.bits == 4) {
          for (; c + 32 <= d; c += 32) {
            __m256i qi[4];
            for (int k = 0; k < 4; ++k) {
              const int ck = c + 8 * k;
              qi[k] = QuantizeChunk(load(row + ck), _mm256_loadu_ps(zf.data() + ck),
                                    _mm256_loadu_ps(inv.data() + ck), qmax);
            }
            StoreCodes32x4(codes, t * d + c, qi[0], qi[1], qi[2], qi[3]);
          }
        }
        for (; c < d; c += 8) {
          const __m256i qi = QuantizeChunk(load(row + c), _mm256_loadu_ps(zf.data() + c),
                                           _mm256_loadu_ps(inv.data() + c), qmax);
          StoreCodes8(codes, q.bits, t * d + c, qi);
        }
      }
    }
    report();
    return;
  }
  // Groups of channels per token, eight (token, group) pairs at a time (they
  // are consecutive in scales and zeros): their minima and maxima reduced
  // together, scales and zeros computed in one vector (the same operations
  // as one at a time, so the same values), then each group quantized.
  // The pairs' token and group advance by counting (a 64-bit division per
  // pair cost as much as its arithmetic).
  const int groups = (d + q.group - 1) / q.group;
  const int64_t pairs = q.tq * groups;
  int64_t start = 0;
  if (q.group == 32 && d % 32 == 0) {
    // KIVI's default: groups of 32 tile each token, so pair i is elements
    // [32i, 32i + 32) and its codes start at byte 4 * bits * i. Whole blocks
    // of eight pairs here, with fixed trip counts; the rest below.
    start = pairs / 8 * 8;
    for (int64_t i0 = 0; i0 < start; i0 += 8) {
      const int64_t e0 = i0 * 32;
      __m256 mn[8], mx[8];
      for (int k = 0; k < 8; ++k) {
        __m256 v[4];
        for (int j = 0; j < 4; ++j) {
          v[j] = load(e0 + 32 * k + 8 * j);
          track(v[j]);
        }
        mn[k] = _mm256_min_ps(_mm256_min_ps(v[0], v[1]), _mm256_min_ps(v[2], v[3]));
        mx[k] = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
      }
      const __m256 lo = Reduce8MinMax<false>(mn), hi = Reduce8MinMax<true>(mx);
      const __m128i s16 = _mm256_cvtps_ph(_mm256_div_ps(_mm256_sub_ps(hi, lo), qmax), 0);
      const __m128i z16 = _mm256_cvtps_ph(lo, 0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(scales + i0), s16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(zeros + i0), z16);
      alignas(32) float invs[8], zs[8];
      _mm256_store_ps(invs, InvScale(_mm256_cvtph_ps(s16)));
      _mm256_store_ps(zs, _mm256_cvtph_ps(z16));
      for (int k = 0; k < 8; ++k) {
        const __m256 inv = _mm256_broadcast_ss(invs + k), zv = _mm256_broadcast_ss(zs + k);
        const int64_t e = e0 + 32 * k;
        __m256i qi[4];
        for (int j = 0; j < 4; ++j) qi[j] = QuantizeChunk(load(e + 8 * j), zv, inv, qmax);
        if (q.bits == 4) {
          StoreCodes32x4(codes, e, qi[0], qi[1], qi[2], qi[3]);
        } else {
          for (int j = 0; j < 4; ++j) StoreCodes8(codes, q.bits, e + 8 * j, qi[j]);
        }
      }
    }
  }
  int64_t next_t = start / groups;
  int next_g = static_cast<int>(start % groups);
  for (int64_t i0 = start; i0 < pairs; i0 += 8) {
    const int nb = static_cast<int>(std::min<int64_t>(8, pairs - i0));
    __m256 mn[8], mx[8];
    int64_t rows[8];  // Each pair's token's first element.
    int c0s[8];       // Each pair's first channel.
    for (int k = 0; k < 8; ++k) {
      if (k >= nb) {
        mn[k] = mx[k] = _mm256_setzero_ps();
        continue;
      }
      rows[k] = next_t * d;
      c0s[k] = next_g * q.group;
      if (++next_g == groups) {
        next_g = 0;
        ++next_t;
      }
      const int c0 = c0s[k];
      const int c1 = std::min(d, c0 + q.group);
      mn[k] = load(rows[k] + c0);
      mx[k] = mn[k];
      track(mn[k]);
      for (int c = c0 + 8; c < c1; c += 8) {
        const __m256 v = load(rows[k] + c);
        track(v);
        mn[k] = _mm256_min_ps(mn[k], v);
        mx[k] = _mm256_max_ps(mx[k], v);
      }
    }
    const __m256 lo = Reduce8MinMax<false>(mn), hi = Reduce8MinMax<true>(mx);
    const __m128i s16 = _mm256_cvtps_ph(_mm256_div_ps(_mm256_sub_ps(hi, lo), qmax), 0);
    const __m128i z16 = _mm256_cvtps_ph(lo, 0);
    if (nb == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(scales + i0), s16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(zeros + i0), z16);
    } else {
      alignas(16) uint16_t sv[8], zv[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(sv), s16);
      _mm_store_si128(reinterpret_cast<__m128i*>(zv), z16);
      for (int k = 0; k < nb; ++k) {
        StoreU16(scales, i0 + k, sv[k]);
        StoreU16(zeros, i0 + k, zv[k]);
      }
    }
    const __m256 invs = InvScale(_mm256_cvtph_ps(s16)), zs = _mm256_cvtph_ps(z16);
    for (int k = 0; k < nb; ++k) {
      const int64_t row = rows[k];
      const int c0 = c0s[k];
      const int c1 = std::min(d, c0 + q.group);
      const __m256i lane = _mm256_set1_epi32(k);
      const __m256 inv = _mm256_permutevar8x32_ps(invs, lane);
      const __m256 zv = _mm256_permutevar8x32_ps(zs, lane);
      int c = c0;
      // 32 codes at a time when they start on a byte (row + c even).
      if (q.bits == 4 && ((row + c) & 1) == 0) {
        for (; c + 32 <= c1; c += 32) {
          StoreCodes32x4(codes, row + c, QuantizeChunk(load(row + c), zv, inv, qmax),
                         QuantizeChunk(load(row + c + 8), zv, inv, qmax),
                         QuantizeChunk(load(row + c + 16), zv, inv, qmax),
                         QuantizeChunk(load(row + c + 24), zv, inv, qmax));
        }
      }
      for (; c < c1; c += 8) {
        StoreCodes8(codes, q.bits, row + c, QuantizeChunk(load(row + c), zv, inv, qmax));
      }
    }
  }
  report();
}

}  // namespace

bool QuantizeSlabSimd(const QuantShape& q, const float* x, uint8_t* codes, uint16_t* scales,
                      uint16_t* zeros, uint32_t* max_abs_bits) {
  if (!SimdAvailable() || !Supported(q)) return false;
  QuantizeSlab<DType::kFp32>(q, x, codes, scales, zeros, max_abs_bits);
  return true;
}

bool QuantizeSlab16Simd(const QuantShape& q, const uint16_t* x, bool bf16, uint8_t* codes,
                        uint16_t* scales, uint16_t* zeros, uint32_t* max_abs_bits) {
  if (!SimdAvailable() || !Supported(q)) return false;
  if (bf16) {
    QuantizeSlab<DType::kBf16>(q, x, codes, scales, zeros, max_abs_bits);
  } else {
    QuantizeSlab<DType::kFp16>(q, x, codes, scales, zeros, max_abs_bits);
  }
  return true;
}

bool FirstOutOfRangeSimd(const float* x, int64_t n, float limit, int64_t* first) {
  if (!SimdAvailable()) return false;
  // |x| as integer bits orders like |x|, with Inf and NaN above every finite
  // value: one unsigned max per block, and a scan only of a block that fails.
  uint32_t limit_bits;
  std::memcpy(&limit_bits, &limit, 4);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  constexpr int64_t kBlock = 256;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    int64_t i = b;
    __m256i m = _mm256_setzero_si256();
    for (; i + 8 <= e; i += 8) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      m = _mm256_max_epu32(m, _mm256_and_si256(v, abs_mask));
    }
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
    uint32_t mx = 0;
    for (uint32_t l : lanes) mx = std::max(mx, l);
    for (; i < e; ++i) {
      uint32_t u;
      std::memcpy(&u, x + i, 4);
      mx = std::max(mx, u & 0x7fffffffu);
    }
    if (mx <= limit_bits) continue;
    for (int64_t j = b; j < e; ++j) {
      if (!(std::fabs(x[j]) <= limit)) {
        *first = j;
        return true;
      }
    }
  }
  *first = -1;
  return true;
}

bool WidenSimd(const uint16_t* x, bool bf16, int64_t n, float* out) {
  if (!SimdAvailable()) return false;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    const __m256 f = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                          : _mm256_cvtph_ps(h);
    _mm256_storeu_ps(out + i, f);
  }
  for (; i < n; ++i) out[i] = bf16 ? Bf16ToFloat(LoadU16(x, i)) : HalfToFloat(LoadU16(x, i));
  return true;
}

bool AxpySimd(float a, const float* x, int64_t n, float* y) {
  if (!SimdAvailable()) return false;
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += a * x[i];
  return true;
}

bool DotSimd(const float* x, const float* y, int64_t n, float* dot) {
  if (!SimdAvailable()) return false;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8)
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
  float sum = HSum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) sum += x[i] * y[i];
  *dot = sum;
  return true;
}

bool DequantRowsSimd(const QuantShape& q, const uint8_t* codes, const uint16_t* scales,
                     const uint16_t* zeros, int64_t t0, int64_t t1, float* out) {
  if (!SimdAvailable() || !Supported(q)) return false;
  const int d = q.d;
  if (q.key) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / q.group;
      float* o = out + (t - t0) * d;
      for (int c = 0; c < d; c += 8) {
        const __m256 v =
            _mm256_fmadd_ps(LoadCodes8(codes, q.bits, t * d + c), LoadHalf8(scales + g * d + c),
                            LoadHalf8(zeros + g * d + c));
        _mm256_storeu_ps(o + c, v);
      }
    }
    return true;
  }
  const int groups = (d + q.group - 1) / q.group;
  for (int64_t t = t0; t < t1; ++t) {
    float* o = out + (t - t0) * d;
    for (int g = 0; g < groups; ++g) {
      const __m256 sv = _mm256_set1_ps(_cvtsh_ss(LoadU16(scales, t * groups + g)));
      const __m256 zv = _mm256_set1_ps(_cvtsh_ss(LoadU16(zeros, t * groups + g)));
      const int c1 = std::min(d, (g + 1) * q.group);
      for (int c = g * q.group; c < c1; c += 8) {
        _mm256_storeu_ps(o + c, _mm256_fmadd_ps(LoadCodes8(codes, q.bits, t * d + c), sv, zv));
      }
    }
  }
  return true;
}

}  // namespace kvtier::internal
