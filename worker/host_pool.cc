// The host pool of a speculating session: the eviction plan (pool::), and
// Session::TrimPool, which applies it to the working set.
#include "worker/host_pool.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <utility>

#include "base/status_macros.h"
#include "encoded/encode.h"
#include "worker/session.h"

namespace kvtier::worker {
namespace pool {

uint64_t PlanEviction(const Cells& cells, double excess, Drops* drops) {
  const size_t rounds = cells.size();
  if (rounds == 0) return 0;
  const size_t layers = cells[0].size();
  const size_t heads = layers > 0 ? cells[0][0].size() : 0;
  drops->resize(rounds);
  for (size_t r = 0; r < rounds; ++r) {
    (*drops)[r].resize(layers);
    for (size_t l = 0; l < layers; ++l) (*drops)[r][l].resize(heads);
  }
  auto gone = [&](size_t r, size_t l, size_t h, int64_t t) {
    const std::vector<char>& v = (*drops)[r][l][h];
    return !v.empty() && v[t] != 0;
  };
  auto fetches = [&](const Cell& c, int64_t t) -> uint32_t {
    return c.fetches != nullptr ? c.fetches[t] : 0;
  };
  uint64_t dropped = 0;
  auto drop = [&](size_t r, size_t l, size_t h, int64_t t) {
    std::vector<char>& v = (*drops)[r][l][h];
    if (v.empty()) v.assign(cells[r][l][h].len, 0);
    v[t] = 1;
    excess -= cells[r][l][h].row_bytes;
    ++dropped;
  };
  // Per layer and head, where its older half ends: the first (round, row)
  // past it.
  std::vector<std::vector<std::pair<size_t, int64_t>>> end(
      layers, std::vector<std::pair<size_t, int64_t>>(heads));
  // Per cell, its newest remaining row: never a candidate (an encoded
  // tensor holds at least one token).
  std::vector<std::vector<std::vector<int64_t>>> newest(
      rounds, std::vector<std::vector<int64_t>>(layers, std::vector<int64_t>(heads, -1)));
  auto candidate = [&](size_t r, size_t l, size_t h, int64_t t) {
    return std::make_pair(r, t) < end[l][h] && t != newest[r][l][h] && !gone(r, l, h, t);
  };
  int64_t longest = 0;
  for (const auto& round : cells) {
    for (const auto& layer : round) {
      for (const Cell& c : layer) longest = std::max(longest, c.len);
    }
  }
  while (excess > 0) {
    for (size_t l = 0; l < layers; ++l) {
      for (size_t h = 0; h < heads; ++h) {
        int64_t left = 0;
        for (size_t r = 0; r < rounds; ++r) {
          newest[r][l][h] = -1;
          for (int64_t t = 0; t < cells[r][l][h].len; ++t) {
            if (gone(r, l, h, t)) continue;
            ++left;
            newest[r][l][h] = t;
          }
        }
        int64_t half = left / 2;
        end[l][h] = {0, 0};
        for (size_t r = 0; r < rounds && half > 0; ++r) {
          for (int64_t t = 0; t < cells[r][l][h].len && half > 0; ++t) {
            if (!gone(r, l, h, t) && --half == 0) end[l][h] = {r, t + 1};
          }
        }
      }
    }
    // The candidates' bytes by fetch count, and the count at which they
    // cover the excess.
    std::map<uint32_t, double> by_fetches;
    for (size_t r = 0; r < rounds; ++r) {
      for (size_t l = 0; l < layers; ++l) {
        for (size_t h = 0; h < heads; ++h) {
          const Cell& c = cells[r][l][h];
          for (int64_t t = 0; t < c.len; ++t) {
            if (candidate(r, l, h, t)) by_fetches[fetches(c, t)] += c.row_bytes;
          }
        }
      }
    }
    if (by_fetches.empty()) break;  // Nothing left to drop.
    uint32_t cut = std::numeric_limits<uint32_t>::max();
    bool all = true;
    double below = 0;
    for (const auto& [f, bytes] : by_fetches) {
      if (below + bytes >= excess) {
        cut = f;
        all = false;
        break;
      }
      below += bytes;
    }
    // Everything fetched less than `cut` goes; then the rows fetched exactly
    // `cut` times, oldest first, until the excess is covered.
    for (size_t r = 0; r < rounds; ++r) {
      for (size_t l = 0; l < layers; ++l) {
        for (size_t h = 0; h < heads; ++h) {
          const Cell& c = cells[r][l][h];
          for (int64_t t = 0; t < c.len; ++t) {
            if (candidate(r, l, h, t) && (all || fetches(c, t) < cut)) drop(r, l, h, t);
          }
        }
      }
    }
    if (all) continue;
    for (size_t r = 0; r < rounds && excess > 0; ++r) {
      for (int64_t t = 0; t < longest && excess > 0; ++t) {
        for (size_t l = 0; l < layers && excess > 0; ++l) {
          for (size_t h = 0; h < heads && excess > 0; ++h) {
            const Cell& c = cells[r][l][h];
            if (t < c.len && candidate(r, l, h, t) && fetches(c, t) == cut) drop(r, l, h, t);
          }
        }
      }
    }
  }
  return dropped;
}

}  // namespace pool

namespace {

// `rl` (layer `layer` of a past round) without the rows `drop` marks (per
// KV head; an empty entry drops nothing), re-encoded with `codec`. Fetch
// counters and partial keys follow their rows.
absl::StatusOr<std::unique_ptr<RoundLayer>> Reencode(const RoundLayer& rl,
                                                     const std::vector<std::vector<char>>& drop,
                                                     const CodecConfig& codec, int layer, int d,
                                                     KernelLevel level) {
  const int hkv = static_cast<int>(rl.heads.size());
  std::vector<std::vector<int64_t>> kept(hkv);
  std::vector<TensorEncoder> encs;
  std::vector<size_t> sizes;
  for (int h = 0; h < hkv; ++h) {
    for (int64_t t = 0; t < rl.heads[h].len; ++t) {
      if (drop[h].empty() || drop[h][t] == 0) kept[h].push_back(t);
    }
    const int64_t shape[3] = {1, static_cast<int64_t>(kept[h].size()), d};
    for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
      KVT_ASSIGN_OR_RETURN(TensorEncoder e,
                           TensorEncoder::Make(codec, role, shape, static_cast<uint32_t>(layer)));
      sizes.push_back(e.SerializedSize());
      encs.push_back(std::move(e));
    }
  }
  std::vector<float> rows, scratch;
  std::vector<uint8_t> raw;
  absl::Status encoded;
  std::string payload = SerializePayload(sizes, [&](size_t i, uint8_t* p) {
    const int h = static_cast<int>(i / 2);
    const EncodedView& view = i % 2 == 0 ? rl.heads[h].kview : rl.heads[h].vview;
    const std::vector<int64_t>& k = kept[h];
    // Runs of consecutive rows move together.
    auto runs = [&](auto&& move) {
      for (size_t j = 0; j < k.size();) {
        size_t e = j + 1;
        while (e < k.size() && k[e] == k[e - 1] + 1) ++e;
        move(k[j], k[e - 1] + 1, j);
        j = e;
      }
    };
    absl::StatusOr<uint8_t*> end;
    if (view.codec == Codec::kRaw && codec.codec == Codec::kRaw && view.dtype == codec.dtype &&
        view.token_stride == d) {
      // Raw rows stay in their dtype: copied, not widened and narrowed.
      const size_t row = static_cast<size_t>(d) * DTypeSize(view.dtype);
      raw.resize(k.size() * row);
      runs([&](int64_t t0, int64_t t1, size_t at) {
        std::memcpy(raw.data() + at * row, static_cast<const uint8_t*>(view.raw) + t0 * row,
                    static_cast<size_t>(t1 - t0) * row);
      });
      end = encs[i].EncodeTo(raw.data(), view.dtype, p, &scratch, level);
    } else {
      rows.resize(k.size() * d);
      runs([&](int64_t t0, int64_t t1, size_t at) {
        DecodeRows(view, 0, t0, t1, rows.data() + at * d, level);
      });
      end = encs[i].EncodeTo(rows.data(), p, level);
    }
    if (!end.ok()) {
      if (encoded.ok()) encoded = end.status();
      return p + sizes[i];
    }
    return *end;
  });
  KVT_RETURN_IF_ERROR(encoded);
  auto own = std::make_shared<const std::string>(std::move(payload));
  KVT_ASSIGN_OR_RETURN(auto made, MakeLayers(std::move(own), 1, hkv, d));
  std::unique_ptr<RoundLayer> out = std::move(made[0]);
  out->trimmed = true;
  if (!rl.fetches.empty()) {
    out->fetches.resize(hkv);
    for (int h = 0; h < hkv; ++h) {
      const std::vector<uint32_t>& f = rl.fetches[h];
      for (int64_t t : kept[h]) {
        out->fetches[h].push_back(static_cast<size_t>(t) < f.size() ? f[t] : 0);
      }
    }
  }
  if (rl.partial_skew != nullptr) {
    out->partial.resize(hkv);
    for (int h = 0; h < hkv; ++h) {
      const int64_t len = rl.heads[h].len;
      if (len == 0) continue;
      const size_t r = rl.partial[h].size() / static_cast<size_t>(len);
      for (int64_t t : kept[h]) {
        const auto from = rl.partial[h].begin() + static_cast<ptrdiff_t>(t * r);
        out->partial[h].insert(out->partial[h].end(), from, from + static_cast<ptrdiff_t>(r));
      }
    }
    out->partial_skew = rl.partial_skew;
    out->partial_serial = NewPartialSerial();
  }
  return out;
}

// The serialized K and V of one KV head of `rows` rows at `layer`.
absl::StatusOr<size_t> HeadBytes(const CodecConfig& codec, int layer, int d, int64_t rows) {
  size_t b = 0;
  const int64_t shape[3] = {1, rows, d};
  for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
    KVT_ASSIGN_OR_RETURN(TensorEncoder e,
                         TensorEncoder::Make(codec, role, shape, static_cast<uint32_t>(layer)));
    b += e.SerializedSize();
  }
  return b;
}

}  // namespace

absl::StatusOr<PoolTrim> Engine::Session::TrimPool(const CodecConfig& codec, KernelLevel level) {
  PoolTrim trim;
  const int64_t cap = policy.speculation.pool_bytes;
  if (cap <= 0 || skew == nullptr || device != nullptr) return trim;
  trim.cap_bytes = static_cast<uint64_t>(cap);
  const auto start = std::chrono::steady_clock::now();
  const int layers = shape.layers, hkv = shape.kv_heads, d = shape.head_dim;
  // Layer 0 attends densely (speculation starts at layer 1): not pool.
  auto pool_bytes = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    uint64_t b = 0;
    for (const PastRound& r : past) {
      for (int l = 1; l < layers; ++l) {
        if (r.layers[l] != nullptr) b += static_cast<uint64_t>(r.layers[l]->bytes);
      }
    }
    return b;
  };
  trim.bytes_before = trim.bytes_after = pool_bytes();
  if (trim.bytes_before <= trim.cap_bytes) {
    trim.ms = MsSince(start);
    return trim;
  }
  // Above the cap: down to the low mark (the cap itself when none is set).
  const uint64_t target = policy.speculation.pool_low_bytes > 0
                              ? static_cast<uint64_t>(policy.speculation.pool_low_bytes)
                              : trim.cap_bytes;
  // A plan works on per-row estimates; the re-encoded sizes differ a little
  // (each tensor's fixed part, codec groups), so a second plan may follow.
  // Per layer, one row's K and V bytes: the tensors' fixed part.
  std::vector<size_t> one_row(layers, 0);
  for (int l = 1; l < layers && trim.bytes_after > target; ++l) {
    KVT_ASSIGN_OR_RETURN(one_row[l], HeadBytes(codec, l, d, 1));
  }
  for (int attempt = 0; attempt < 4 && trim.bytes_after > target; ++attempt) {
    pool::Cells cells(past.size(),
                      std::vector<std::vector<pool::Cell>>(layers, std::vector<pool::Cell>(hkv)));
    for (size_t r = 0; r < past.size(); ++r) {
      for (int l = 1; l < layers; ++l) {
        const RoundLayer* rl = past[r].layers[l].get();
        if (rl == nullptr) continue;
        for (int h = 0; h < hkv; ++h) {
          pool::Cell& c = cells[r][l][h];
          c.len = rl->heads[h].len;
          if (c.len == 0) continue;
          c.fetches = rl->FetchCounts(h).data();
          if (c.len < 2) continue;  // Its one row stays.
          // What a row adds: the head's bytes less those of one row (the
          // tensors' fixed part), over the other rows.
          const size_t one = one_row[l];
          const size_t all = rl->tensors[2 * h].size() + rl->tensors[2 * h + 1].size();
          c.row_bytes =
              static_cast<double>(all > one ? all - one : 0) / static_cast<double>(c.len - 1);
        }
      }
    }
    pool::Drops drops;
    const uint64_t n =
        pool::PlanEviction(cells, static_cast<double>(trim.bytes_after - target), &drops);
    if (n == 0) break;
    // Every new layer first, then the swap: a failure changes nothing.
    std::vector<std::pair<std::unique_ptr<RoundLayer>*, std::unique_ptr<RoundLayer>>> made;
    for (size_t r = 0; r < past.size(); ++r) {
      for (int l = 1; l < layers; ++l) {
        const std::vector<std::vector<char>>& dl = drops[r][l];
        if (std::all_of(dl.begin(), dl.end(), [](const auto& v) { return v.empty(); })) continue;
        KVT_ASSIGN_OR_RETURN(auto nl, Reencode(*past[r].layers[l], dl, codec, l, d, level));
        made.emplace_back(&past[r].layers[l], std::move(nl));
      }
    }
    for (auto& [slot, nl] : made) *slot = std::move(nl);
    trim.evicted_tokens += n;
    trim.reencoded_layers += made.size();
    trim.bytes_after = pool_bytes();
  }
  trim.ms = MsSince(start);
  return trim;
}

}  // namespace kvtier::worker
