// kvtier-bench pool: the host pool of a speculating session (docs/
// speculation.md#the-host-pool) at a model's size. Two sessions of the same
// worker engine (in this process, over one kvtier-store process) get the same
// prefills and speculating decode steps, round after round, every round
// resident (release_after_end_round off, so the pool is every layer from 1
// on): one with a pool cap, one without (the same-run baseline). Per round:
// the pool's bytes, what the trim evicted and re-encoded, its time, and
// EndRound's time with the cap against without.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/benches.h"
#include "bench/engine_store.h"
#include "kernels/speculation.h"
#include "worker/engine.h"

namespace kvtier::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

void Usage() {
  std::fprintf(stderr,
               "kvtier-bench pool [--layers=32] [--heads=8] [--head_dim=128] [--tokens=128]\n"
               "                  [--rounds=8] [--decode=4] [--codec=kivi4] [--cap=0.5] [--low=0]\n"
               "  Two speculating sessions, every round resident: one whose host pool is capped\n"
               "  at --cap of one round's pool times --rounds, one without a cap (the baseline,\n"
               "  same inputs, same run). Prints the pool, the trims and EndRound's time.\n"
               "  --low=F (0 < F < 1) adds a third session with the same cap whose trims stop\n"
               "  at F of it (Policy.speculation_pool_low_bytes).\n");
}

}  // namespace

int PoolBench(int argc, char** argv) {
  worker::ModelShape shape{32, 8, 8, 128, DType::kFp16};
  int64_t tokens = 128;
  int rounds = 8, decode = 4;
  std::string codec = "kivi4";
  double cap_fraction = 0.5, low_fraction = 0;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) { return FlagValue(a, flag); };
    if (const char* v = value("--layers=")) {
      shape.layers = std::atoi(v);
    } else if (const char* v = value("--heads=")) {
      shape.q_heads = shape.kv_heads = std::atoi(v);
    } else if (const char* v = value("--head_dim=")) {
      shape.head_dim = std::atoi(v);
    } else if (const char* v = value("--tokens=")) {
      tokens = std::atoll(v);
    } else if (const char* v = value("--rounds=")) {
      rounds = std::atoi(v);
    } else if (const char* v = value("--decode=")) {
      decode = std::atoi(v);
    } else if (const char* v = value("--codec=")) {
      codec = v;
    } else if (const char* v = value("--cap=")) {
      cap_fraction = std::atof(v);
    } else if (const char* v = value("--low=")) {
      low_fraction = std::atof(v);
    } else {
      Usage();
      return 2;
    }
  }
  auto config = ParseCodecSetting(codec);
  if (shape.layers < 2 || shape.q_heads < 1 || shape.head_dim < 8 || tokens < 2 || rounds < 2 ||
      decode < 1 || !(cap_fraction > 0 && cap_fraction < 1) ||
      !(low_fraction >= 0 && low_fraction < 1) || !config.ok()) {
    Usage();
    return 2;
  }
  auto store = EngineStore::Start(
      "pool",
      {"--ram_budget_mb=8192", "--max_segment_mb=512", "--log_level=warn", "--sync_writes=false"},
      absl::Seconds(120));
  if (store == nullptr) return 1;
  worker::EngineOptions eo;
  eo.placement = worker::EngineOptions::Placement::kHost;
  worker::Engine engine(store->segments(), eo);

  // A skew calibrated on random queries and keys (the trim's cost does not
  // depend on which tokens speculation picks, only on how many rows move).
  std::mt19937 rng(5);
  const int d = shape.head_dim, hq = shape.q_heads, hkv = shape.kv_heads;
  spec::SkewModel skew;
  skew.model = "bench";
  skew.layers = shape.layers;
  skew.q_heads = hq;
  skew.kv_heads = hkv;
  skew.head_dim = d;
  skew.partial_ratio = 0.2;
  skew.calibration_tokens = 64;
  for (int l = 0; l < shape.layers; ++l) {
    const auto q = DrawHalfExact(size_t{64} * hq * d, &rng),
               k = DrawHalfExact(size_t{64} * hkv * d, &rng);
    auto heads = spec::CalibrateLayer(q.data(), k.data(), 64, hq, hkv, d, 0.2);
    if (!heads.ok()) {
      std::fprintf(stderr, "kvtier-bench pool: %s\n", heads.status().ToString().c_str());
      return 1;
    }
    skew.heads.push_back(*heads);
  }
  auto skew_id = engine.skews().Put(spec::SerializeSkew(skew));
  if (!skew_id.ok()) {
    std::fprintf(stderr, "kvtier-bench pool: %s\n", skew_id.status().ToString().c_str());
    return 1;
  }
  worker::SessionPolicy policy;
  policy.codec = *config;
  policy.recall.mode = RecallMode::kAll;
  policy.release_after_end_round = false;
  policy.speculation.skew = *skew_id;
  // The baseline's cap is beyond reach: it reports its pool and never trims.
  policy.speculation.pool_bytes = int64_t{1} << 56;
  const worker::SessionKey free_id("free"), capped_id("capped"), low_id("low");
  const int sessions = low_fraction > 0 ? 3 : 2;
  if (absl::Status s = engine.OpenSession(free_id, shape, policy); !s.ok()) {
    std::fprintf(stderr, "kvtier-bench pool: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf(
      "kvtier-bench pool: %d layers, %d heads of %d, %s, %d rounds of %lld tokens + %d "
      "speculating decode steps\n",
      shape.layers, hq, d, CodecSettingName(*config).c_str(), rounds,
      static_cast<long long>(tokens), decode);
  std::printf("%-5s %12s %12s %12s %9s %9s %9s %14s %14s %7s", "round", "pool free MiB",
              "capped MiB", "after MiB", "evicted", "re-enc", "trim ms", "EndRound free",
              "EndRound cap", "ratio");
  if (sessions == 3) {
    std::printf(" %12s %9s %9s %14s %7s", "low: MiB", "after", "trim ms", "EndRound", "ratio");
  }
  std::printf("\n");
  double end_free = 0, end_capped = 0, trim_total = 0, end_low = 0, trim_low = 0;
  int trims = 0, trims_low = 0;
  for (int r = 0; r < rounds; ++r) {
    // One round's inputs, run through both sessions.
    std::vector<std::vector<float>> pq, pk, pv;
    for (int l = 0; l < shape.layers; ++l) {
      pq.push_back(DrawHalfExact(static_cast<size_t>(tokens) * hq * d, &rng));
      pk.push_back(DrawHalfExact(static_cast<size_t>(tokens) * hkv * d, &rng));
      pv.push_back(DrawHalfExact(static_cast<size_t>(tokens) * hkv * d, &rng));
    }
    std::vector<std::vector<std::vector<float>>> dq(decode), dk(decode), dv(decode), dn(decode);
    for (int s = 0; s < decode; ++s) {
      for (int l = 0; l < shape.layers; ++l) {
        dq[s].push_back(DrawHalfExact(static_cast<size_t>(hq) * d, &rng));
        dk[s].push_back(DrawHalfExact(static_cast<size_t>(hkv) * d, &rng));
        dv[s].push_back(DrawHalfExact(static_cast<size_t>(hkv) * d, &rng));
        dn[s].push_back(DrawHalfExact(static_cast<size_t>(hq) * d, &rng));
      }
    }
    worker::EndRoundReport reps[3];
    double ms[3] = {0, 0, 0};
    for (int which = 0; which < sessions; ++which) {
      const worker::SessionKey& id = which == 0 ? free_id : which == 1 ? capped_id : low_id;
      if (which >= 1 && r == 0) {
        // The cap: a fraction of what every round would hold, from the
        // baseline's first round; the third session's trims stop lower.
        worker::SessionPolicy p = policy;
        p.speculation.pool_bytes = static_cast<int64_t>(
            cap_fraction * rounds * static_cast<double>(reps[0].pool.bytes_before));
        if (which == 2) {
          p.speculation.pool_low_bytes =
              static_cast<int64_t>(low_fraction * static_cast<double>(p.speculation.pool_bytes));
        }
        if (absl::Status s = engine.OpenSession(id, shape, p); !s.ok()) {
          std::fprintf(stderr, "kvtier-bench pool: %s\n", s.ToString().c_str());
          return 1;
        }
      }
      std::vector<float> out(static_cast<size_t>(tokens) * hq * d);
      for (int l = 0; l < shape.layers; ++l) {
        auto st = engine.PrefillLayer(id, l, tokens, 0, pq[l].data(), pk[l].data(), pv[l].data(),
                                      out.data());
        if (!st.ok()) {
          std::fprintf(stderr, "kvtier-bench pool: %s\n", st.status().ToString().c_str());
          return 1;
        }
      }
      for (int s = 0; s < decode; ++s) {
        for (int l = 0; l < shape.layers; ++l) {
          absl::Status st =
              engine.DecodeLayer(id, l, dq[s][l].data(), dk[s][l].data(), dv[s][l].data(),
                                 out.data(), l + 1 < shape.layers ? dn[s][l].data() : nullptr);
          if (!st.ok()) {
            std::fprintf(stderr, "kvtier-bench pool: %s\n", st.ToString().c_str());
            return 1;
          }
        }
      }
      const auto t0 = Clock::now();
      auto rep = engine.EndRound(id);
      ms[which] = Ms(t0, Clock::now());
      if (!rep.ok()) {
        std::fprintf(stderr, "kvtier-bench pool: %s\n", rep.status().ToString().c_str());
        return 1;
      }
      reps[which] = *rep;
    }
    end_free += ms[0];
    end_capped += ms[1];
    trim_total += reps[1].pool.ms;
    trims += reps[1].pool.evicted_tokens > 0 ? 1 : 0;
    end_low += ms[2];
    trim_low += reps[2].pool.ms;
    trims_low += reps[2].pool.evicted_tokens > 0 ? 1 : 0;
    const double mib = 1 << 20;
    std::printf("%-5d %12.1f %12.1f %12.1f %9llu %9llu %9.1f %14.1f %14.1f %6.2fx", r,
                static_cast<double>(reps[0].pool.bytes_before) / mib,
                static_cast<double>(reps[1].pool.bytes_before) / mib,
                static_cast<double>(reps[1].pool.bytes_after) / mib,
                static_cast<unsigned long long>(reps[1].pool.evicted_tokens),
                static_cast<unsigned long long>(reps[1].pool.reencoded_layers), reps[1].pool.ms,
                ms[0], ms[1], ms[0] > 0 ? ms[1] / ms[0] : 0.0);
    if (sessions == 3) {
      std::printf(" %12.1f %9.1f %9.1f %14.1f %6.2fx",
                  static_cast<double>(reps[2].pool.bytes_before) / mib,
                  static_cast<double>(reps[2].pool.bytes_after) / mib, reps[2].pool.ms, ms[2],
                  ms[0] > 0 ? ms[2] / ms[0] : 0.0);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  std::printf(
      "EndRound, all rounds: %.1f ms with the cap against %.1f ms without (%.2fx, same run); "
      "%d trims took %.1f ms of it (wall time)\n",
      end_capped, end_free, end_free > 0 ? end_capped / end_free : 0.0, trims, trim_total);
  if (sessions == 3) {
    std::printf(
        "With trims stopping at %.2f of the cap: EndRound %.1f ms (%.2fx without a cap); %d "
        "trims took %.1f ms (%.2fx the trims to the cap)\n",
        low_fraction, end_low, end_free > 0 ? end_low / end_free : 0.0, trims_low, trim_low,
        trim_total > 0 ? trim_low / trim_total : 0.0);
  }
  return 0;
}

}  // namespace kvtier::bench
