// Reference quantization kernels: float64 arithmetic and plain loops. They
// define what the vectorized and CUDA levels must reproduce.
#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/codec_internal.h"
#include "kernels/half.h"

namespace kvtier::internal {
namespace {

void PutCode(uint8_t* codes, int bits, int64_t i, uint32_t code) {
  const int per_word = 32 / bits;
  uint32_t w;
  std::memcpy(&w, codes + (i / per_word) * 4, 4);
  w |= code << ((i % per_word) * bits);
  std::memcpy(codes + (i / per_word) * 4, &w, 4);
}

uint32_t GetCode(const uint8_t* codes, int bits, int64_t i) {
  const int per_word = 32 / bits;
  uint32_t w;
  std::memcpy(&w, codes + (i / per_word) * 4, 4);
  return (w >> ((i % per_word) * bits)) & ((1u << bits) - 1u);
}

// Quantizes the elements x[idx(0..n)] of one group.
template <typename Index>
void QuantizeGroup(int bits, const float* x, int n, Index idx, uint8_t* codes, uint16_t* scale_out,
                   uint16_t* zero_out) {
  double mn = x[idx(0)], mx = x[idx(0)];
  for (int j = 1; j < n; ++j) {
    mn = std::min(mn, static_cast<double>(x[idx(j)]));
    mx = std::max(mx, static_cast<double>(x[idx(j)]));
  }
  const double qmax = static_cast<double>((1 << bits) - 1);
  const uint16_t scale16 = FloatToHalf(static_cast<float>((mx - mn) / qmax));
  const uint16_t zero16 = FloatToHalf(static_cast<float>(mn));
  StoreU16(scale_out, 0, scale16);
  StoreU16(zero_out, 0, zero16);
  const double scale = HalfToFloat(scale16);
  const double zero = HalfToFloat(zero16);
  for (int j = 0; j < n; ++j) {
    // NaN input (refused by the check that follows encoding) gets code 0:
    // std::clamp would pass a NaN through, and its conversion to an integer
    // is undefined.
    double q = 0.0;
    const double y = scale > 0.0 ? (x[idx(j)] - zero) / scale : 0.0;
    if (y > 0.0) q = std::min(std::nearbyint(y), qmax);
    PutCode(codes, bits, idx(j), static_cast<uint32_t>(q));
  }
}

}  // namespace

void QuantizeSlabRef(const QuantShape& q, const float* x, uint8_t* codes, uint16_t* scales,
                     uint16_t* zeros) {
  const int d = q.d;
  if (q.key) {
    const int64_t groups = (q.tq + q.group - 1) / q.group;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t t0 = g * q.group;
      const int n = static_cast<int>(std::min<int64_t>(q.group, q.tq - t0));
      for (int c = 0; c < d; ++c) {
        QuantizeGroup(
            q.bits, x, n, [&](int j) { return (t0 + j) * d + c; }, codes, &scales[g * d + c],
            &zeros[g * d + c]);
      }
    }
  } else {
    const int groups = (d + q.group - 1) / q.group;
    for (int64_t t = 0; t < q.tq; ++t) {
      for (int g = 0; g < groups; ++g) {
        const int c0 = g * q.group;
        const int n = std::min(q.group, d - c0);
        QuantizeGroup(
            q.bits, x, n, [&](int j) { return t * d + c0 + j; }, codes, &scales[t * groups + g],
            &zeros[t * groups + g]);
      }
    }
  }
}

void DequantRowsRef(const QuantShape& q, const uint8_t* codes, const uint16_t* scales,
                    const uint16_t* zeros, int64_t t0, int64_t t1, float* out) {
  const int d = q.d;
  const int vgroups = (d + q.group - 1) / q.group;
  for (int64_t t = t0; t < t1; ++t) {
    for (int c = 0; c < d; ++c) {
      const int64_t si = q.key ? (t / q.group) * d + c : t * vgroups + c / q.group;
      const double scale = HalfToFloat(LoadU16(scales, si));
      const double zero = HalfToFloat(LoadU16(zeros, si));
      const double code = GetCode(codes, q.bits, t * d + c);
      out[(t - t0) * d + c] = static_cast<float>(code * scale + zero);
    }
  }
}

// CPUID leaf 1, ECX bit 29. Asked directly: clang's __builtin_cpu_supports
// does not know "f16c".
bool HasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
}

bool SimdAvailable() {
  static const bool available = [] {
    const char* env = std::getenv("KVTIER_SIMD");
    if (env != nullptr && std::string(env) == "off") return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && HasF16c() &&
           __builtin_cpu_supports("bmi2");
  }();
  return available;
}

namespace {
std::atomic<bool> vnni_wanted{true};
}  // namespace

bool VnniCpu() {
  static const bool present = [] {
    const char* env = std::getenv("KVTIER_VNNI");
    if (env != nullptr && std::string(env) == "off") return false;
    __builtin_cpu_init();
    return SimdAvailable() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
  }();
  return present;
}

bool VnniAvailable() { return VnniCpu() && vnni_wanted.load(std::memory_order_relaxed); }

bool SetVnni(bool on) { return vnni_wanted.exchange(on, std::memory_order_relaxed); }

float LoadElement(DType dtype, const void* ptr, int64_t index) {
  switch (dtype) {
    case DType::kFp16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const uint8_t*>(ptr) + index * 2, 2);
      return HalfToFloat(h);
    }
    case DType::kBf16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const uint8_t*>(ptr) + index * 2, 2);
      return Bf16ToFloat(h);
    }
    default: {
      float f;
      std::memcpy(&f, static_cast<const uint8_t*>(ptr) + index * 4, 4);
      return f;
    }
  }
}

}  // namespace kvtier::internal

namespace kvtier {

const char* VectorIsaName() {
  return internal::SimdAvailable() ? "avx2+fma+f16c+bmi2" : "scalar (reference)";
}

}  // namespace kvtier
