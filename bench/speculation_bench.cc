// kvtier-bench speculation: what a speculating decode layer costs against
// dense attention over the same past rounds, through the worker engine (in
// this process, over one kvtier-store process). Four sessions get the same
// inputs: a past round of --tokens tokens (encoded with --codec, kept
// resident), then a short prefill and --decode decode steps, each layer with
// its next layer's query:
//   cpu dense        host working set, no speculation;
//   cpu speculation  host working set, speculation (docs/speculation.md);
//   gpu dense        the working set on the GPU (placement device);
//   gpu speculation  past rounds in the host pool, selection, gather upload
//                    and attention on the GPU's two streams.
// The GPU rows need a CUDA device; without one they say so. Per session: the
// median wall time of one DecodeLayer at layers 1 and up (layer 0 always
// attends densely) over steps 1 and up, the same-run ratio against its
// placement's dense session, and step 0's mean per layer (a speculating
// session makes each round layer's partial keys then). The skew is the identity (the first
// --partial columns): the cost does not depend on which tokens are picked, only on how many, and
// --budget fixes that (alpha is set so high that every head's count is
// every token, so n = the budget).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench/benches.h"
#include "bench/engine_store.h"
#include "kernels/speculation.h"
#include "worker/device/attention.h"
#include "worker/engine.h"

namespace kvtier::bench {
namespace {

using Clock = std::chrono::steady_clock;

void Usage() {
  std::fprintf(
      stderr,
      "kvtier-bench speculation [--layers=8] [--q_heads=32] [--kv_heads=8] [--head_dim=128]\n"
      "                         [--tokens=4096] [--budget=256] [--partial=26] [--decode=8]\n"
      "                         [--codec=kivi4] [--cpu=true]\n"
      "  Per-layer decode time of a speculating session against dense attention over the\n"
      "  same past round, on the CPU and (with a CUDA device) on the GPU; same inputs,\n"
      "  same run. --cpu=false runs the GPU sessions only.\n");
}

struct Session {
  const char* name = "";
  worker::Engine* engine = nullptr;
  bool speculates = false;
  std::vector<double> layer_ms;  // Decode layers 1 and up, steps 1 and up.
  double first_ms = 0;           // Decode layers 1 and up of step 0, summed.
  bool ran = false;
  std::string why;  // Why it did not run.
  // SessionStats::speculation_time after step 0 and at the end: the
  // difference is steps 1 and up.
  worker::SessionStats::SpeculationTime after_first, at_end;
};

}  // namespace

int SpeculationBench(int argc, char** argv) {
  worker::ModelShape shape{8, 32, 8, 128, DType::kFp16};
  int64_t tokens = 4096;
  int budget = 256, partial = 26, decode = 8;
  std::string codec = "kivi4";
  bool cpu = true;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) { return FlagValue(a, flag); };
    if (const char* v = value("--layers=")) {
      shape.layers = std::atoi(v);
    } else if (const char* v = value("--q_heads=")) {
      shape.q_heads = std::atoi(v);
    } else if (const char* v = value("--kv_heads=")) {
      shape.kv_heads = std::atoi(v);
    } else if (const char* v = value("--head_dim=")) {
      shape.head_dim = std::atoi(v);
    } else if (const char* v = value("--tokens=")) {
      tokens = std::atoll(v);
    } else if (const char* v = value("--budget=")) {
      budget = std::atoi(v);
    } else if (const char* v = value("--partial=")) {
      partial = std::atoi(v);
    } else if (const char* v = value("--decode=")) {
      decode = std::atoi(v);
    } else if (const char* v = value("--codec=")) {
      codec = v;
    } else if (const char* v = value("--cpu=")) {
      cpu = std::string(v) != "false";
    } else {
      Usage();
      return a == "--help" ? 0 : 2;
    }
  }
  auto config = ParseCodecSetting(codec);
  if (shape.layers < 2 || shape.kv_heads < 1 || shape.q_heads % shape.kv_heads != 0 ||
      shape.head_dim < 8 || tokens < 2 || budget < 1 || partial < 1 || partial > shape.head_dim ||
      decode < 1 || !config.ok()) {
    Usage();
    return 2;
  }
  auto store = EngineStore::Start(
      "speculation",
      {"--ram_budget_mb=16384", "--max_segment_mb=1024", "--log_level=warn", "--sync_writes=false"},
      absl::Seconds(300));
  if (store == nullptr) return 1;
  worker::EngineOptions host_opts, device_opts;
  host_opts.placement = worker::EngineOptions::Placement::kHost;
  device_opts.placement = worker::EngineOptions::Placement::kDevice;
  worker::Engine host(store->segments(), host_opts), device(store->segments(), device_opts);

  const int d = shape.head_dim, hq = shape.q_heads, hkv = shape.kv_heads;
  const spec::SkewModel skew = spec::IdentitySkew(shape.layers, hq, hkv, d, partial);
  const std::string skew_bytes = spec::SerializeSkew(skew);
  std::string skew_id;
  for (worker::Engine* e : {&host, &device}) {
    auto id = e->skews().Put(skew_bytes);
    if (!id.ok()) {
      std::fprintf(stderr, "kvtier-bench speculation: %s\n", id.status().ToString().c_str());
      return 1;
    }
    skew_id = *id;
  }
  worker::SessionPolicy dense;
  dense.codec = *config;
  dense.recall.mode = RecallMode::kAll;
  dense.release_after_end_round = false;
  worker::SessionPolicy speculating = dense;
  speculating.speculation.skew = skew_id;
  speculating.speculation.alpha = 1e30f;  // Every token counts: n = the budget.
  speculating.speculation.budget = budget;

  std::printf(
      "kvtier-bench speculation: %d layers, %d q / %d kv heads of %d, %s past round of %lld "
      "tokens, budget %d tokens per head, %d partial columns, %d decode steps\n",
      shape.layers, hq, hkv, d, CodecSettingName(*config).c_str(), static_cast<long long>(tokens),
      budget, partial, decode);
  std::mt19937 rng(9);
  std::vector<std::vector<float>> pq, pk, pv;
  for (int l = 0; l < shape.layers; ++l) {
    pq.push_back(DrawHalfExact(static_cast<size_t>(tokens) * hq * d, &rng));
    pk.push_back(DrawHalfExact(static_cast<size_t>(tokens) * hkv * d, &rng));
    pv.push_back(DrawHalfExact(static_cast<size_t>(tokens) * hkv * d, &rng));
  }
  constexpr int64_t kQuestion = 16;
  std::vector<std::vector<float>> qq, qk, qv;
  for (int l = 0; l < shape.layers; ++l) {
    qq.push_back(DrawHalfExact(static_cast<size_t>(kQuestion) * hq * d, &rng));
    qk.push_back(DrawHalfExact(static_cast<size_t>(kQuestion) * hkv * d, &rng));
    qv.push_back(DrawHalfExact(static_cast<size_t>(kQuestion) * hkv * d, &rng));
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

  std::vector<Session> sessions(4);
  const char* names[] = {"cpu dense", "cpu speculation", "gpu dense", "gpu speculation"};
  for (size_t i = 0; i < sessions.size(); ++i) {
    sessions[i].name = names[i];
    sessions[i].engine = i < 2 ? &host : &device;
    sessions[i].speculates = i % 2 == 1;
  }
  for (size_t i = 0; i < sessions.size(); ++i) {
    Session& s = sessions[i];
    const worker::SessionKey id(absl::StrCat("spec-", i));
    const bool on_gpu = s.engine == &device;
    if (on_gpu && !worker::DeviceUsable()) {
      s.why = std::string(worker::DeviceStatus().message());
      continue;
    }
    if (!on_gpu && !cpu) {
      s.why = "--cpu=false";
      continue;
    }
    std::fprintf(stderr, "%s...\n", s.name);
    auto fail = [&](const absl::Status& st) {
      std::fprintf(stderr, "kvtier-bench speculation: %s: %s\n", s.name, st.ToString().c_str());
      return 1;
    };
    if (absl::Status st = s.engine->OpenSession(id, shape, s.speculates ? speculating : dense);
        !st.ok()) {
      return fail(st);
    }
    auto stats = s.engine->Stats(id);
    if (!stats.ok()) return fail(stats.status());
    if (on_gpu && (s.speculates ? !stats->speculation_on_device : !stats->on_device)) {
      return fail(absl::InternalError("the session is not on the GPU"));
    }
    std::vector<float> out(static_cast<size_t>(tokens) * hq * d);
    for (int l = 0; l < shape.layers; ++l) {
      auto st = s.engine->PrefillLayer(id, l, tokens, 0, pq[l].data(), pk[l].data(), pv[l].data(),
                                       out.data());
      if (!st.ok()) return fail(st.status());
    }
    if (auto rep = s.engine->EndRound(id); !rep.ok()) return fail(rep.status());
    for (int l = 0; l < shape.layers; ++l) {
      auto st = s.engine->PrefillLayer(id, l, kQuestion, kQuestion, qq[l].data(), qk[l].data(),
                                       qv[l].data(), out.data());
      if (!st.ok()) return fail(st.status());
    }
    for (int step = 0; step < decode; ++step) {
      for (int l = 0; l < shape.layers; ++l) {
        const auto t0 = Clock::now();
        absl::Status st = s.engine->DecodeLayer(
            id, l, dq[step][l].data(), dk[step][l].data(), dv[step][l].data(), out.data(),
            s.speculates && l + 1 < shape.layers ? dn[step][l].data() : nullptr);
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        if (!st.ok()) return fail(st);
        if (l >= 1 && step == 0) s.first_ms += ms;
        if (l >= 1 && step > 0) s.layer_ms.push_back(ms);
      }
      if (step == 0 || step + 1 == decode) {
        auto now = s.engine->Stats(id);
        if (!now.ok()) return fail(now.status());
        (step == 0 ? s.after_first : s.at_end) = now->speculation_time;
      }
    }
    if (auto rep = s.engine->EndRound(id); !rep.ok()) return fail(rep.status());
    (void)s.engine->CloseSession(id, /*delete_from_store=*/true, {});
    s.ran = true;
  }
  std::printf(
      "\n| session | ms per decode layer (median, layers 1+, steps 1+) | against dense, same "
      "placement | step 0, ms per layer |\n");
  std::printf("|---|---|---|---|\n");
  for (size_t i = 0; i < sessions.size(); ++i) {
    const Session& s = sessions[i];
    if (!s.ran) {
      std::printf("| %s | not run: %s | | |\n", s.name, s.why.c_str());
      continue;
    }
    const double ms = Median(s.layer_ms);
    const double first = s.first_ms / (shape.layers - 1);
    const Session& base = sessions[i & ~size_t{1}];
    if (s.speculates && base.ran) {
      std::printf("| %s | %.3f | %.2fx | %.3f |\n", s.name, ms, ms / Median(base.layer_ms), first);
    } else {
      std::printf("| %s | %.3f | | %.3f |\n", s.name, ms, first);
    }
  }
  // Where a speculating layer's time went (SessionStats::speculation_time).
  bool header = false;
  for (const Session& s : sessions) {
    if (!s.ran || !s.speculates) continue;
    const auto& a = s.after_first;
    const auto& b = s.at_end;
    const double n = static_cast<double>(b.steps - a.steps);
    if (n <= 0) continue;
    auto per = [n](absl::Duration d) { return absl::ToDoubleMilliseconds(d) / n; };
    if (!header) {
      std::printf(
          "\nWhere a speculated layer step went, steps 1+ (ms each, host wall clock; on the GPU, "
          "select and attend include waiting for the device):\n"
          "| session | layer steps | select | gather | upload | attend | hit-rate samples | sum |\n"
          "|---|---|---|---|---|---|---|---|\n");
      header = true;
    }
    const double sel = per(b.select - a.select), gat = per(b.gather - a.gather),
                 up = per(b.upload - a.upload), att = per(b.attend - a.attend),
                 smp = per(b.sample - a.sample);
    std::printf("| %s | %.0f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", s.name, n, sel, gat,
                up, att, smp, sel + gat + up + att + smp);
  }
  return 0;
}

}  // namespace kvtier::bench
