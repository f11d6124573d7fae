#include "kernels/recall.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvtier {

absl::StatusOr<RecallStrategy> ParseRecall(const std::string& text) {
  RecallStrategy s;
  if (text == "all") {
    s.mode = RecallMode::kAll;
    s.param = 0;
    return s;
  }
  const size_t colon = text.find(':');
  const std::string name = text.substr(0, colon);
  const std::string arg = colon == std::string::npos ? "" : text.substr(colon + 1);
  double v = 0;
  if (!absl::SimpleAtod(arg, &v) || !std::isfinite(v)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "recall '", text, "': expected all, topk:K, adaptive:LAMBDA, threshold:THETA or mass:P"));
  }
  if (name == "topk") {
    if (v < 1 || v != std::floor(v)) {
      return absl::InvalidArgumentError(absl::StrCat("recall topk needs K >= 1, got ", arg));
    }
    s.mode = RecallMode::kTopK;
  } else if (name == "adaptive") {
    s.mode = RecallMode::kAdaptive;
  } else if (name == "threshold") {
    if (v < 0 || v > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("recall threshold must be in [0, 1], got ", arg));
    }
    s.mode = RecallMode::kThreshold;
  } else if (name == "mass") {
    if (v <= 0 || v > 1) {
      return absl::InvalidArgumentError(absl::StrCat("recall mass must be in (0, 1], got ", arg));
    }
    s.mode = RecallMode::kMass;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "recall '", text, "': expected all, topk:K, adaptive:LAMBDA, threshold:THETA or mass:P"));
  }
  s.param = v;
  return s;
}

std::string RecallName(const RecallStrategy& s) {
  switch (s.mode) {
    case RecallMode::kAll:
      return "all";
    case RecallMode::kTopK:
      return absl::StrCat("topk:", static_cast<int>(s.param));
    case RecallMode::kAdaptive:
      return absl::StrCat("adaptive:", s.param);
    case RecallMode::kThreshold:
      return absl::StrCat("threshold:", s.param);
    case RecallMode::kMass:
      return absl::StrCat("mass:", s.param);
  }
  return "?";
}

std::vector<double> QAttention(int q_heads, int kv_heads, int d, const float* q, int64_t q_stride,
                               int64_t question_tokens, const std::vector<RoundKeys>& rounds,
                               const float* cur_k) {
  std::vector<double> mass(rounds.size(), 0.0);
  if (rounds.empty()) return mass;
  const int rep = q_heads / kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> s;
  for (int64_t i = 0; i < question_tokens; ++i) {
    for (int hq = 0; hq < q_heads; ++hq) {
      const int h = hq / rep;
      const float* qi = q + i * q_stride + static_cast<int64_t>(hq) * d;
      auto dot = [&](const float* k) {
        double acc = 0;
        for (int c = 0; c < d; ++c) acc += static_cast<double>(qi[c]) * k[c];
        return acc * scale;
      };
      s.clear();
      for (const RoundKeys& r : rounds) {
        for (int64_t j = 0; j < r.lens[h]; ++j) s.push_back(dot(r.keys[h] + j * d));
      }
      for (int64_t j = 0; j <= i; ++j) s.push_back(dot(cur_k + (j * kv_heads + h) * d));
      const double m = *std::max_element(s.begin(), s.end());
      double z = 0;
      for (double& x : s) z += (x = std::exp(x - m));
      size_t at = 0;
      for (size_t r = 0; r < rounds.size(); ++r) {
        double acc = 0;
        for (int64_t j = 0; j < rounds[r].lens[h]; ++j) acc += s[at++];
        mass[r] += acc / z;
      }
    }
  }
  const double total = std::accumulate(mass.begin(), mass.end(), 0.0);
  if (total > 0) {
    for (double& m : mass) m /= total;
  } else {
    for (double& m : mass) m = 1.0 / static_cast<double>(mass.size());
  }
  return mass;
}

std::vector<uint32_t> SelectRounds(const std::vector<double>& scores, const RecallStrategy& s,
                                   bool keep_recent) {
  const size_t n = scores.size();
  std::vector<bool> pick(n, false);
  switch (s.mode) {
    case RecallMode::kAll:
      pick.assign(n, true);
      break;
    case RecallMode::kTopK:
    case RecallMode::kMass: {
      const size_t k = s.mode == RecallMode::kTopK
                           ? static_cast<size_t>(s.param)
                           : static_cast<size_t>(RoundsForMass(scores, s.param));
      std::vector<uint32_t> order(n);
      std::iota(order.begin(), order.end(), 0u);
      // Higher score first; ties to the more recent round.
      std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
        return scores[a] > scores[b] || (scores[a] == scores[b] && a > b);
      });
      for (size_t i = 0; i < std::min(n, k); ++i) pick[order[i]] = true;
      break;
    }
    case RecallMode::kAdaptive: {
      if (n == 0) break;
      const double mean = std::accumulate(scores.begin(), scores.end(), 0.0) / n;
      double var = 0;
      for (double x : scores) var += (x - mean) * (x - mean);
      const double cut = mean + s.param * std::sqrt(var / n);
      for (size_t i = 0; i < n; ++i) pick[i] = scores[i] >= cut;
      break;
    }
    case RecallMode::kThreshold:
      for (size_t i = 0; i < n; ++i) pick[i] = scores[i] >= s.param;
      break;
  }
  if (keep_recent && n > 0) pick[n - 1] = true;
  std::vector<uint32_t> out;
  for (size_t i = 0; i < n; ++i) {
    if (pick[i]) out.push_back(static_cast<uint32_t>(i));
  }
  return out;
}

int RoundsForMass(const std::vector<double>& scores, double mass) {
  std::vector<double> sorted = scores;
  std::sort(sorted.rbegin(), sorted.rend());
  double acc = 0;
  for (size_t i = 0; i < sorted.size(); ++i) {
    acc += sorted[i];
    if (acc >= mass - 1e-12) return static_cast<int>(i + 1);
  }
  return static_cast<int>(sorted.size());
}

}  // namespace kvtier
