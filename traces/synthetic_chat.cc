#include "traces/synthetic_chat.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"

namespace kvtier::traces {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer.
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

void Gaussian(std::mt19937_64& rng, float* x, int n, float scale) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int i = 0; i < n; ++i) x[i] = scale * g(rng);
}

void Normalize(float* x, int n, float norm) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  const float f = s > 0 ? static_cast<float>(norm / std::sqrt(s)) : 0.0f;
  for (int i = 0; i < n; ++i) x[i] *= f;
}

}  // namespace

absl::Status ValidateSyntheticChat(const SyntheticChatOptions& o) {
  if (o.layers < 2 || o.q_heads < 1 || o.kv_heads < 1 || o.q_heads % o.kv_heads != 0 ||
      o.head_dim < 1 || o.head_dim > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic chat: bad shape (layers ", o.layers, " >= 2, kv_heads ", o.kv_heads,
                     " must divide q_heads ", o.q_heads, ", head_dim ", o.head_dim, ")"));
  }
  if (o.rounds < 1 || o.question_tokens < 1 || o.answer_tokens < 0) {
    return absl::InvalidArgumentError("synthetic chat: rounds and question tokens must be >= 1");
  }
  if (o.topic_layer < 0 || o.topic_layer >= o.layers || o.max_refs < 1 ||
      o.recent_ref_probability < 0 || o.recent_ref_probability > 1 || !(o.topic_strength >= 0) ||
      !(o.key_noise >= 0)) {
    return absl::InvalidArgumentError(
        "synthetic chat: topic_layer must be a layer, max_refs >= 1, the probability in [0, 1] "
        "and strengths >= 0");
  }
  return absl::OkStatus();
}

SyntheticChat::SyntheticChat(const SyntheticChatOptions& o) : o_(o) {
  const int d = o.head_dim, hk = o.kv_heads;
  const size_t per_round = static_cast<size_t>(hk) * d;
  topics_.resize(o.rounds * per_round);
  means_.resize(o.rounds * per_round);
  directions_.assign(o.rounds * per_round, 0.0f);
  std::mt19937_64 rng(Mix(o.seed));
  for (int r = 0; r < o.rounds; ++r) {
    for (int h = 0; h < hk; ++h) {
      float* t = &topics_[r * per_round + h * d];
      Gaussian(rng, t, d, 1.0f);
      Normalize(t, d, std::sqrt(static_cast<float>(d)));
      Gaussian(rng, &means_[r * per_round + h * d], d, 1.0f);
    }
  }
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int hq = 0; hq < o.q_heads; ++hq) {
    head_scale_.push_back(static_cast<float>(0.75 + 0.5 * u(rng)));
  }
  refs_.resize(o.rounds);
  weights_.resize(o.rounds);
  for (int r = 1; r < o.rounds; ++r) {
    const int m = std::min(r, 1 + static_cast<int>(u(rng) * o.max_refs));
    std::vector<int> pool(r);
    for (int i = 0; i < r; ++i) pool[i] = i;
    std::vector<int> refs;
    if (u(rng) < o.recent_ref_probability) {
      refs.push_back(r - 1);
      pool.pop_back();
    }
    while (static_cast<int>(refs.size()) < m && !pool.empty()) {
      const size_t i = static_cast<size_t>(u(rng) * pool.size()) % pool.size();
      refs.push_back(pool[i]);
      pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(i));
    }
    std::sort(refs.begin(), refs.end());
    refs_[r] = refs;
    for (size_t i = 0; i < refs.size(); ++i) {
      weights_[r].push_back(static_cast<float>(0.6 + 0.4 * u(rng)));
    }
  }
  // Topical query direction per round and KV head: the weighted references
  // plus the round's own topic, unit norm.
  for (int r = 0; r < o.rounds; ++r) {
    for (int h = 0; h < hk; ++h) {
      float* dir = &directions_[r * per_round + h * d];
      const float* own = &topics_[r * per_round + h * d];
      for (int c = 0; c < d; ++c) dir[c] = own[c];
      for (size_t i = 0; i < refs_[r].size(); ++i) {
        const float* t = &topics_[refs_[r][i] * per_round + h * d];
        for (int c = 0; c < d; ++c) dir[c] += weights_[r][i] * t[c];
      }
      Normalize(dir, d, 1.0f);
    }
  }
}

void SyntheticChat::Token(int round, int token, int layer, float* q, float* k, float* v) const {
  const int d = o_.head_dim, hk = o_.kv_heads, rep = o_.q_heads / o_.kv_heads;
  const size_t per_round = static_cast<size_t>(hk) * d;
  std::mt19937_64 rng(Mix(Mix(Mix(o_.seed ^ 0x5eedull) + static_cast<uint64_t>(round)) +
                          (static_cast<uint64_t>(token) << 16 | static_cast<uint64_t>(layer))));
  const float sqrt_d = std::sqrt(static_cast<float>(d));
  for (int h = 0; h < hk; ++h) {
    const float* t = &topics_[round * per_round + h * d];
    const float* mean = &means_[round * per_round + h * d];
    Gaussian(rng, k + h * d, d, o_.key_noise);
    Gaussian(rng, v + h * d, d, 1.0f);
    for (int c = 0; c < d; ++c) {
      k[h * d + c] += t[c];
      v[h * d + c] += mean[c];
    }
  }
  const float g = layer >= o_.topic_layer
                      ? 1.0f
                      : static_cast<float>(layer) / static_cast<float>(o_.topic_layer);
  std::vector<float> random(d);
  for (int h = 0; h < hk; ++h) {
    const float* dir = &directions_[round * per_round + h * d];
    Gaussian(rng, random.data(), d, 1.0f);
    Normalize(random.data(), d, 1.0f);
    for (int j = 0; j < rep; ++j) {
      const int hq = h * rep + j;
      const float s = o_.topic_strength * head_scale_[hq] * sqrt_d;
      for (int c = 0; c < d; ++c) {
        q[hq * d + c] = s * (g * dir[c] + (1.0f - g) * random[c]);
      }
    }
  }
}

}  // namespace kvtier::traces
