#include "bench/gpu_step.h"

#include <cmath>

#include "kernels/attention.h"

namespace kvtier::bench::gpu {
namespace {

// A deterministic stream of roughly normal values (sum of uniforms).
class Noise {
 public:
  explicit Noise(uint64_t seed) : s_(seed * 0x9e3779b97f4a7c15ULL + 1) {}
  float Next() {
    float sum = 0;
    for (int i = 0; i < 4; ++i) {
      s_ ^= s_ << 13;
      s_ ^= s_ >> 7;
      s_ ^= s_ << 17;
      sum += static_cast<float>(s_ >> 40) / static_cast<float>(1 << 24);
    }
    return (sum - 2.0f) * 1.7f;
  }

 private:
  uint64_t s_;
};

}  // namespace

// Writes over a buffer larger than the L2 cache before each timed launch, so
// that a step reads its K/V from device memory, as a decode step does after
// the other layers' steps (a 4K-token fp16 layer would otherwise sit in L2).
void FlushL2() {
  static void* buf = [] {
    void* p = nullptr;
    GPU_CHECK(cudaMalloc(&p, size_t{256} << 20));
    return p;
  }();
  GPU_CHECK(cudaMemsetAsync(buf, 0, size_t{256} << 20));
}

[[noreturn]] void Die(const char* what, const absl::Status& st) {
  std::fprintf(stderr, "kvtier-gpu-bench: %s: %s\n", what, st.ToString().c_str());
  std::exit(2);
}

Step Prepare(const std::string& setting, int64_t t, uint64_t salt) {
  auto codec = ParseCodecSetting(setting);
  if (!codec.ok()) Die("--codecs", codec.status());
  const int d = kDim;
  Noise noise(static_cast<uint64_t>(t) * 31 + setting.size() + salt * 7919);
  Step st;
  st.tokens = t;
  st.tensors.reserve(2 * kKvHeads);  // Views point into them: no reallocation.
  st.k_dec.resize(kKvHeads);
  st.v_dec.resize(kKvHeads);
  std::vector<float> x(static_cast<size_t>(t) * d);
  for (int h = 0; h < kKvHeads; ++h) {
    worker::StagedKv parts[2];
    EncodedView views[2];
    for (int role = 0; role < 2; ++role) {
      for (size_t i = 0; i < x.size(); ++i) {
        x[i] = noise.Next() + (role == 0 && i % d == static_cast<size_t>(h) ? 3.0f : 0.0f);
      }
      const int64_t shape[3] = {1, t, d};
      auto enc = EncodedBlock::Encode(*codec, role == 0 ? TensorRole::kKey : TensorRole::kValue,
                                      shape, x.data());
      if (!enc.ok()) Die("encode", enc.status());
      st.tensors.push_back(*std::move(enc));
      const EncodedView* view = &st.tensors.back().view();
      auto staged = worker::StageView(*view, d, &st.staged);
      if (!staged.ok()) Die("stage", staged.status());
      parts[role] = *std::move(staged);
      views[role] = *view;
      std::vector<float>& dec = role == 0 ? st.k_dec[h] : st.v_dec[h];
      dec.resize(x.size());
      DecodeRows(*view, 0, 0, t, dec.data());
    }
    st.heads.emplace_back(std::move(parts[0]), std::move(parts[1]));
    st.views.emplace_back(views[0], views[1]);
  }
  st.q.resize(static_cast<size_t>(kQHeads) * d);
  st.open_k.resize(static_cast<size_t>(kKvHeads) * d);
  st.open_v.resize(st.open_k.size());
  for (float& v : st.q) v = noise.Next() * 0.3f;
  for (float& v : st.open_k) v = noise.Next();
  for (float& v : st.open_v) v = noise.Next();
  return st;
}

// Attention of the step in float64 over the reconstruction plus the open
// row: [q_heads, d].
std::vector<double> Reference(const Step& st) {
  const int d = kDim, rep = kQHeads / kKvHeads;
  const int64_t t = st.tokens;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> out(static_cast<size_t>(kQHeads) * d), s(static_cast<size_t>(t) + 1);
  for (int j = 0; j < kQHeads; ++j) {
    const int h = j / rep;
    const float* qj = st.q.data() + j * d;
    double mx = -1e300;
    for (int64_t i = 0; i <= t; ++i) {
      const float* k = i < t ? st.k_dec[h].data() + i * d : st.open_k.data() + h * d;
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += static_cast<double>(qj[c]) * k[c];
      s[i] = dot * scale;
      mx = std::max(mx, s[i]);
    }
    double sum = 0;
    double* o = out.data() + j * d;
    for (int64_t i = 0; i <= t; ++i) {
      const double p = std::exp(s[i] - mx);
      sum += p;
      const float* v = i < t ? st.v_dec[h].data() + i * d : st.open_v.data() + h * d;
      for (int c = 0; c < d; ++c) o[c] += p * v[c];
    }
    for (int c = 0; c < d; ++c) o[c] /= sum;
  }
  return out;
}

// ||got - want|| / ||want||; infinite when `got` holds a non-finite value.
double RelError(const std::vector<float>& got, const std::vector<double>& want) {
  double err2 = 0, ref2 = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    err2 += (got[i] - want[i]) * (got[i] - want[i]);
    ref2 += want[i] * want[i];
  }
  return std::sqrt(err2 / std::max(ref2, 1e-300));
}

// The fewest bytes the kernel must move: the encoded K/V (the staged array,
// alignment padding aside), the open rows and the query once, the output once.
double FloorBytes(const Step& st) {
  size_t encoded = 0;
  for (const auto& [k, v] : st.heads) {
    for (const worker::StagedRegion& r : k.regions) encoded += r.size;
    for (const worker::StagedRegion& r : v.regions) encoded += r.size;
  }
  return static_cast<double>(encoded + 2 * st.open_k.size() * sizeof(float) +
                             2 * st.q.size() * sizeof(float));
}

}  // namespace kvtier::bench::gpu
