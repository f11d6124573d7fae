#include "model/qmatrix.h"

#include <cstring>

#include "kernels/codec_internal.h"
#include "kernels/half.h"
#include "model/matmul.h"
#include "model/quant_internal.h"

namespace kvtier::model {
namespace {

using internal::HalfAt;
using internal::ScaleMinK4;

// One block of type t (BlockWeights(t) weights) into codes q, and per group
// of `group` weights a scale and a bias, as DequantizeRow computes them.
void Block(GgmlType t, const uint8_t* b, int8_t* q, float* s, float* bias) {
  switch (t) {
    case GgmlType::kQ8_0:
      std::memcpy(q, b + 2, 32);
      s[0] = HalfAt(b);
      bias[0] = 0;
      return;
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1: {
      const bool min = t == GgmlType::kQ4_1;
      const uint8_t* qs = b + (min ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        q[j] = static_cast<int8_t>((qs[j] & 0xF) - (min ? 0 : 8));
        q[j + 16] = static_cast<int8_t>((qs[j] >> 4) - (min ? 0 : 8));
      }
      s[0] = HalfAt(b);
      bias[0] = min ? HalfAt(b + 2) : 0.0f;
      return;
    }
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1: {
      const bool min = t == GgmlType::kQ5_1;
      const uint8_t* p = b + (min ? 4 : 2);
      uint32_t qh;
      std::memcpy(&qh, p, 4);
      const uint8_t* qs = p + 4;
      for (int j = 0; j < 16; ++j) {
        const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
        q[j] = static_cast<int8_t>(((qs[j] & 0xF) | h0) - (min ? 0 : 16));
        q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | h1) - (min ? 0 : 16));
      }
      s[0] = HalfAt(b);
      bias[0] = min ? HalfAt(b + 2) : 0.0f;
      return;
    }
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K: {
      const bool five = t == GgmlType::kQ5_K;
      const float d = HalfAt(b), dmin = HalfAt(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* ql = b + (five ? 48 : 16);
      for (int g = 0; g < 8; ++g) {
        uint8_t sc, m;
        ScaleMinK4(g, scales, &sc, &m);
        s[g] = d * sc;
        bias[g] = -(dmin * m);
        for (int l = 0; l < 32; ++l) {
          const uint8_t byte = ql[(g / 2) * 32 + l];
          int v = g % 2 == 0 ? byte & 0xF : byte >> 4;
          if (five && (qh[l] >> g & 1)) v += 16;
          q[g * 32 + l] = static_cast<int8_t>(v);
        }
      }
      return;
    }
    case GgmlType::kQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = HalfAt(b + 208);
      for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8) {
        int8_t* y = q + n * 128;
        for (int l = 0; l < 32; ++l) {
          y[l] = static_cast<int8_t>(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
          y[l + 32] = static_cast<int8_t>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
          y[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          y[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
        // Group g of 16 (within this half): weights 16g.. of the 128, whose
        // scale index is g (the layout's is = l / 16 + 2 * quarter).
        for (int g = 0; g < 8; ++g) {
          s[n * 8 + g] = d * static_cast<float>(sc[g]);
          bias[n * 8 + g] = 0;
        }
      }
      return;
    }
    case GgmlType::kQ2_K: {
      const uint8_t* scales = b;
      const uint8_t* qs = b + 16;
      const float d = HalfAt(b + 80), dmin = HalfAt(b + 82);
      int is = 0, at = 0;
      for (int n = 0; n < 2; ++n, qs += 32) {
        for (int j = 0; j < 4; ++j) {
          for (int half = 0; half < 2; ++half, ++is) {
            s[is] = d * static_cast<float>(scales[is] & 0xF);
            bias[is] = -(dmin * static_cast<float>(scales[is] >> 4));
            for (int l = 0; l < 16; ++l) {
              q[at++] = static_cast<int8_t>((qs[l + 16 * half] >> (2 * j)) & 3);
            }
          }
        }
      }
      return;
    }
    default:
      return;
  }
}

}  // namespace

bool QMatrixHolds(GgmlType t) { return BlockWeights(t) > 1; }

QMatrix ToQMatrix(GgmlType t, const void* data, int rows, int cols) {
  QMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.group = t == GgmlType::kQ6_K || t == GgmlType::kQ2_K ? 16 : 32;
  m.q.resize(static_cast<size_t>(rows) * cols);
  m.scale.resize(static_cast<size_t>(rows) * m.groups());
  std::vector<float> bias(m.scale.size());
  const int bw = BlockWeights(t), bb = BlockBytes(t), per_block = bw / m.group;
  const auto* src = static_cast<const uint8_t*>(data);
  bool any_bias = false;
  for (int r = 0; r < rows; ++r) {
    const uint8_t* row = src + RowBytes(t, cols) * r;
    for (int k = 0; k < cols / bw; ++k) {
      const size_t g0 = static_cast<size_t>(r) * m.groups() + static_cast<size_t>(k) * per_block;
      Block(t, row + static_cast<int64_t>(k) * bb,
            m.q.data() + static_cast<size_t>(r) * cols + static_cast<size_t>(k) * bw,
            m.scale.data() + g0, bias.data() + g0);
    }
  }
  for (float b : bias) any_bias |= b != 0;
  if (any_bias) m.bias = std::move(bias);
  return m;
}

void QMatrix::Row(int r, float* out) const {
  const int8_t* qr = q.data() + static_cast<size_t>(r) * cols;
  for (int g = 0; g < groups(); ++g) {
    const size_t gi = static_cast<size_t>(r) * groups() + g;
    const float s = scale[gi], b = bias.empty() ? 0.0f : bias[gi];
    for (int j = 0; j < group; ++j) out[g * group + j] = s * qr[g * group + j] + b;
  }
}

void QMatMul(const float* x, int n, const QMatrix& w, float* out, KernelLevel level,
             ThreadPool* pool) {
  // The bias term of each group is bias * (the sum of x over the group).
  std::vector<float> xsum;
  if (!w.bias.empty()) {
    xsum.resize(static_cast<size_t>(n) * w.groups());
    for (int t = 0; t < n; ++t) {
      for (int g = 0; g < w.groups(); ++g) {
        const float* xg = x + static_cast<size_t>(t) * w.cols + static_cast<size_t>(g) * w.group;
        float s = 0;
        for (int j = 0; j < w.group; ++j) s += xg[j];
        xsum[static_cast<size_t>(t) * w.groups() + g] = s;
      }
    }
  }
  const float* xs = xsum.empty() ? nullptr : xsum.data();
  if (level != KernelLevel::kReference && kvtier::internal::SimdAvailable()) {
    return SplitRows(w.rows, pool,
                     [&](int r0, int r1) { internal::QMatMulAvx2(x, n, w, xs, r0, r1, out); });
  }
  SplitRows(w.rows, pool, [&](int r0, int r1) {
    for (int r = r0; r < r1; ++r) {
      const int8_t* qr = w.q.data() + static_cast<size_t>(r) * w.cols;
      for (int t = 0; t < n; ++t) {
        const float* xt = x + static_cast<size_t>(t) * w.cols;
        float acc = 0, bacc = 0;
        for (int g = 0; g < w.groups(); ++g) {
          const size_t gi = static_cast<size_t>(r) * w.groups() + g;
          const float s = w.scale[gi];
          for (int j = 0; j < w.group; ++j) {
            acc += s * static_cast<float>(qr[g * w.group + j]) * xt[g * w.group + j];
          }
          if (!xsum.empty()) bacc += w.bias[gi] * xsum[static_cast<size_t>(t) * w.groups() + g];
        }
        out[static_cast<size_t>(t) * w.rows + r] = acc + bacc;
      }
    }
  });
}

}  // namespace kvtier::model
