// The tensor-core fragments of kernels/cuda/mma_frag.h on the host: each
// lane's registers built from real rows, one warp's mma.sync.m16n8k16
// emulated from the PTX fragment layout, and the products checked against
// the sums they stand for. Runs in every build; the GPU tests run the kernel.
#include "kernels/cuda/mma_frag.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/half.h"

namespace kvtier::cuda::mma {
namespace {

struct Warp {
  uint32_t a[32][4] = {};
  uint32_t b[32][2] = {};
  float c[32][4] = {};
};

// One mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 over the warp's
// registers, in double, as the PTX ISA lays out the fragments.
void Mma(Warp& w) {
  double a[16][16] = {}, b[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int gid = lane / 4, tid = lane % 4;
    float x, y;
    Unpack(w.a[lane][0], &x, &y);
    a[gid][2 * tid] = x, a[gid][2 * tid + 1] = y;
    Unpack(w.a[lane][1], &x, &y);
    a[gid + 8][2 * tid] = x, a[gid + 8][2 * tid + 1] = y;
    Unpack(w.a[lane][2], &x, &y);
    a[gid][2 * tid + 8] = x, a[gid][2 * tid + 9] = y;
    Unpack(w.a[lane][3], &x, &y);
    a[gid + 8][2 * tid + 8] = x, a[gid + 8][2 * tid + 9] = y;
    Unpack(w.b[lane][0], &x, &y);
    b[2 * tid][gid] = x, b[2 * tid + 1][gid] = y;
    Unpack(w.b[lane][1], &x, &y);
    b[2 * tid + 8][gid] = x, b[2 * tid + 9][gid] = y;
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int gid = lane / 4, tid = lane % 4;
    for (int q = 0; q < 4; ++q) {
      const int row = gid + (q >= 2 ? 8 : 0), col = 2 * tid + q % 2;
      double sum = 0;
      for (int k = 0; k < 16; ++k) sum += a[row][k] * b[k][col];
      w.c[lane][q] += static_cast<float>(sum);
    }
  }
}

// hi's product plus lo's (same A registers, lo's B), into hi's accumulators.
void MmaHiLo(Warp& hi, Warp& lo) {
  for (int lane = 0; lane < 32; ++lane) std::copy(hi.a[lane], hi.a[lane] + 4, lo.a[lane]);
  Mma(hi);
  Mma(lo);
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < 4; ++r) hi.c[lane][r] += lo.c[lane][r];
}

// Rows of 16 tokens: fp16 values (bits 16) or codes, as the kernel reads them.
struct Rows {
  int bits, d;
  std::vector<uint32_t> words;  // [16, words_per_row]
  int per_row() const { return bits == 16 ? d / 2 : d * bits / 32; }
  double at(int t, int c) const {
    if (bits == 16) {
      const uint32_t w = words[t * per_row() + c / 2];
      return HalfToFloat(static_cast<uint16_t>(c % 2 == 0 ? w & 0xffffu : w >> 16));
    }
    const int bit = c * bits;
    return (words[t * per_row() + bit / 32] >> (bit % 32)) & ((1u << bits) - 1u);
  }
};

Rows RandomRows(int bits, int d, std::mt19937& rng) {
  Rows r{bits, d, {}};
  r.words.resize(static_cast<size_t>(16) * r.per_row());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint32_t& w : r.words) {
    if (bits == 16) {
      w = FloatToHalf(normal(rng)) | (static_cast<uint32_t>(FloatToHalf(normal(rng))) << 16);
    } else {
      w = static_cast<uint32_t>(rng());
    }
  }
  return r;
}

// q[8 heads][d] (heads past `heads` zero) or p[8 heads][16 tokens].
std::vector<float> RandomMatrix(int heads, int cols, std::mt19937& rng) {
  std::vector<float> m(static_cast<size_t>(8) * cols, 0.0f);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int h = 0; h < heads; ++h)
    for (int c = 0; c < cols; ++c) m[h * cols + c] = u(rng);
  return m;
}

template <int BITS>
void CheckScores(int d, int heads, std::mt19937& rng) {
  SCOPED_TRACE(testing::Message() << "bits " << BITS << " d " << d << " heads " << heads);
  const Rows k = RandomRows(BITS, d, rng);
  const std::vector<float> q = RandomMatrix(heads, d, rng);
  Warp hi_w, lo_w;
  for (int s = 0; s < d / 16; ++s) {
    for (int lane = 0; lane < 32; ++lane) {
      const int gid = lane / 4, tid = lane % 4;
      uint32_t w0[32], w8[32];  // Rows gid and gid + 8: the lane's words.
      for (int w = 0; w < KeyWords(BITS, d); ++w) {
        w0[w] = k.words[gid * k.per_row() + KeyWordAt(BITS, d, tid, w)];
        w8[w] = k.words[(gid + 8) * k.per_row() + KeyWordAt(BITS, d, tid, w)];
      }
      uint32_t lo0, hi0, lo8, hi8;
      KeyA<BITS>(w0, s, &lo0, &hi0);
      KeyA<BITS>(w8, s, &lo8, &hi8);
      const uint32_t a[4] = {lo0, lo8, hi0, hi8};
      float qv[4];
      for (int e = 0; e < 4; ++e) qv[e] = q[gid * d + KeyChannel(BITS, d, s, tid, e)];
      uint32_t bh[2], bl[2];
      Split(qv[0], qv[1], &bh[0], &bl[0]);
      Split(qv[2], qv[3], &bh[1], &bl[1]);
      for (int r = 0; r < 4; ++r) hi_w.a[lane][r] = lo_w.a[lane][r] = a[r];
      for (int r = 0; r < 2; ++r) hi_w.b[lane][r] = bh[r], lo_w.b[lane][r] = bl[r];
    }
    Mma(hi_w);
    Mma(lo_w);
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int gid = lane / 4, tid = lane % 4;
    for (int r = 0; r < 4; ++r) {
      const int token = gid + (r >= 2 ? 8 : 0), head = 2 * tid + r % 2;
      double want = 0, mag = 0;
      for (int c = 0; c < d; ++c) {
        want += k.at(token, c) * q[head * d + c];
        mag += std::fabs(k.at(token, c) * q[head * d + c]);
      }
      const double got = static_cast<double>(hi_w.c[lane][r]) + lo_w.c[lane][r];
      ASSERT_NEAR(got, want, 2e-6 * (mag + 1)) << "token " << token << " head " << head;
    }
  }
}

TEST(MmaFragTest, ScoresOfFp16AndCodeRowsMatchTheirDotProducts) {
  std::mt19937 rng(7);
  for (int d : {64, 128, 256}) {
    for (int heads : {1, 2, 4, 8}) {
      CheckScores<16>(d, heads, rng);
      CheckScores<4>(d, heads, rng);
      CheckScores<2>(d, heads, rng);
    }
  }
}

// The output's accumulators, m-tile by m-tile, against sum_t p[h][t] (v[t][c]
// - mid).
void CheckOutput(const Rows& v, const std::vector<float>& p, const std::vector<Warp>& tiles,
                 int (*channel)(int m, int gid, int upper), double mid = 0) {
  const int d = v.d;
  for (int m = 0; m < d / 16; ++m) {
    for (int lane = 0; lane < 32; ++lane) {
      const int gid = lane / 4, tid = lane % 4;
      for (int r = 0; r < 4; ++r) {
        const int c = channel(m, gid, r >= 2 ? 1 : 0), head = 2 * tid + r % 2;
        double want = 0, mag = 0;
        for (int t = 0; t < 16; ++t) {
          want += p[head * 16 + t] * (v.at(t, c) - mid);
          mag += std::fabs(p[head * 16 + t] * (v.at(t, c) - mid));
        }
        ASSERT_NEAR(tiles[m].c[lane][r], want, 2e-6 * (mag + 1))
            << "m-tile " << m << " channel " << c << " head " << head;
      }
    }
  }
}

// The weight registers of lane (gid, tid): p of head gid at its 4 tokens.
void WeightB(const std::vector<float>& p, int gid, int tid, uint32_t* hi, uint32_t* lo) {
  const float* w = &p[gid * 16 + 4 * tid];
  Split(w[0], w[1], &hi[0], &lo[0]);
  Split(w[2], w[3], &hi[1], &lo[1]);
}

TEST(MmaFragTest, OutputOfFp16ValuesMatchesTheWeightedSum) {
  std::mt19937 rng(11);
  for (int d : {64, 128, 256}) {
    SCOPED_TRACE(testing::Message() << "d " << d);
    const Rows v = RandomRows(16, d, rng);
    const std::vector<float> p = RandomMatrix(8, 16, rng);
    std::vector<Warp> tiles(d / 16);
    for (int m = 0; m < d / 16; ++m) {
      Warp lo_w;
      for (int lane = 0; lane < 32; ++lane) {
        const int gid = lane / 4, tid = lane % 4;
        uint32_t w[4];
        for (int u = 0; u < 4; ++u)
          w[u] = v.words[(4 * tid + u) * v.per_row() + ValueWordAt16(gid, m)];
        ValueA16(w[0], w[1], w[2], w[3], tiles[m].a[lane]);
        WeightB(p, gid, tid, tiles[m].b[lane], lo_w.b[lane]);
      }
      MmaHiLo(tiles[m], lo_w);
    }
    CheckOutput(v, p, tiles,
                [](int m, int gid, int upper) { return ValueChannel16(m, gid, upper); });
  }
}

template <int BITS, int G>
void CheckQuantizedOutput(int d, std::mt19937& rng) {
  SCOPED_TRACE(testing::Message() << "bits " << BITS << " group " << G << " d " << d);
  const Rows v = RandomRows(BITS, d, rng);
  const std::vector<float> p = RandomMatrix(8, 16, rng);
  std::vector<Warp> tiles(d / 16);
  for (int m = 0; m < d / 16; ++m) {
    const int grp = m / (G / 16), h = m % (G / 16);
    Warp lo_w;
    for (int lane = 0; lane < 32; ++lane) {
      const int gid = lane / 4, tid = lane % 4;
      uint32_t w[4];
      for (int u = 0; u < 4; ++u) {
        w[u] = v.words[(4 * tid + u) * v.per_row() + ValueWordQ(BITS, G, grp, gid)] >>
               ValueShiftQ(BITS, G, gid);
      }
      ValueAQ<BITS>(w[0], w[1], w[2], w[3], h, tiles[m].a[lane]);
      WeightB(p, gid, tid, tiles[m].b[lane], lo_w.b[lane]);
    }
    MmaHiLo(tiles[m], lo_w);
  }
  CheckOutput(
      v, p, tiles, [](int m, int gid, int upper) { return ValueChannelQ(G, m, gid, upper); },
      CodeMid(BITS));
}

TEST(MmaFragTest, OutputOfCentredCodesMatchesTheWeightedSum) {
  std::mt19937 rng(13);
  for (int d : {64, 128, 256}) {
    CheckQuantizedOutput<4, 32>(d, rng);
    CheckQuantizedOutput<4, 64>(d, rng);
    CheckQuantizedOutput<2, 32>(d, rng);
    CheckQuantizedOutput<2, 64>(d, rng);
  }
}

TEST(MmaFragTest, EveryChannelHasOneSlot) {
  for (int bits : {16, 4, 2}) {
    for (int d : {64, 128, 256}) {
      std::vector<int> seen(d, 0);
      for (int s = 0; s < d / 16; ++s)
        for (int tid = 0; tid < 4; ++tid)
          for (int e = 0; e < 4; ++e) ++seen[KeyChannel(bits, d, s, tid, e)];
      for (int c = 0; c < d; ++c)
        EXPECT_EQ(seen[c], 1) << "K bits " << bits << " d " << d << " channel " << c;
    }
  }
  for (int d : {64, 128, 256}) {
    std::vector<int> seen16(d, 0), seen32(d, 0), seen64(d, 0);
    for (int m = 0; m < d / 16; ++m)
      for (int gid = 0; gid < 8; ++gid)
        for (int upper = 0; upper < 2; ++upper) {
          ++seen16[ValueChannel16(m, gid, upper)];
          ++seen32[ValueChannelQ(32, m, gid, upper)];
          ++seen64[ValueChannelQ(64, m, gid, upper)];
        }
    for (int c = 0; c < d; ++c) {
      EXPECT_EQ(seen16[c], 1) << d << " " << c;
      EXPECT_EQ(seen32[c], 1) << d << " " << c;
      EXPECT_EQ(seen64[c], 1) << d << " " << c;
    }
  }
}

}  // namespace
}  // namespace kvtier::cuda::mma
