// The `make demo` workload (refengine/demo.h) against a real kvtier-store
// process and an in-process kvtier-worker: the synthetic chat's memory
// targets with recall (and 4-bit KIVI), recall finding the rounds each
// question refers to, the JSON report's keys, and the stories260K path.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "gtest/gtest.h"
#include "refengine/demo.h"
#include "refengine/watershed.h"
#include "services/worker/worker_server.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"
#include "tests/util/worker_stack.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;

class EngineDemoTest : public ::testing::Test {
 protected:
  void SetUp() override { KVT_ASSERT_OK(stack_.Start()); }

  refengine::DemoOptions Options() {
    refengine::DemoOptions o;
    o.worker = stack_.worker_target();
    o.store = stack_.store()->target();
    return o;
  }

  testing::WorkerStack stack_;
};

// The shared Decode stream replaced before every request: steps under way
// finish on the stream they began on (the worker rolls back a session whose
// step's stream ends), so concurrent sessions with interleaved steps decode
// as on one stream.
TEST_F(EngineDemoTest, SharedDecodeStreamRotatesBetweenSteps) {
  refengine::DemoOptions o = Options();
  o.sessions = 3;
  o.rounds = 4;
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport steady, refengine::RunDemo(o, {}));
  o.decode_stream_rotate = absl::ZeroDuration();
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport rotated, refengine::RunDemo(o, {}));
  ASSERT_EQ(rotated.sessions.size(), 3u);
  EXPECT_GT(rotated.decode_requests, 0u);
  EXPECT_EQ(refengine::OutputsDigest(rotated), refengine::OutputsDigest(steady));
}

double Ratio(const refengine::DemoSession& s) {
  return static_cast<double>(s.rounds.back().round_working_set_bytes) /
         static_cast<double>(s.rounds.back().full_cache_bytes);
}

// The targets on the synthetic chat, 24 rounds, recall keeping the
// rounds that hold 95% of the watershed attention (mass:0.95): working set
// <= 45% of the full cache, and <= 15% with 4-bit KIVI. Byte counts and
// selections are deterministic for a seed; measured 0.383 and 0.147 for
// this session (docs/demo.md).
TEST_F(EngineDemoTest, SyntheticChatMeetsTheMemoryTargets) {
  refengine::DemoOptions o = Options();
  o.sessions = 1;
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport raw, refengine::RunDemo(o, {}));
  ASSERT_EQ(raw.sessions.size(), 1u);
  const refengine::DemoSession& s = raw.sessions[0];
  ASSERT_EQ(s.rounds.size(), 24u);
  EXPECT_LE(Ratio(s), 0.45);
  // Every round after the first recalled; the referenced rounds come back.
  int refs = 0, hits = 0;
  for (size_t r = 1; r < s.rounds.size(); ++r) {
    EXPECT_TRUE(s.rounds[r].recalled);
    EXPECT_EQ(s.rounds[r].scores.size(), r);
    for (int ref : s.references[r]) {
      ++refs;
      hits += std::count(s.rounds[r].selected.begin(), s.rounds[r].selected.end(),
                         static_cast<uint32_t>(ref)) > 0;
    }
  }
  EXPECT_GE(hits, refs * 95 / 100) << hits << " of " << refs;
  // Raw (fp16) with recall: only the unselected ~5% of the mass is lost.
  EXPECT_LT(std::sqrt(s.err2 / s.ref2), 0.03);
  ASSERT_TRUE(raw.store_bytes_disk.has_value());
  EXPECT_GT(*raw.store_bytes_disk, 0u);

  o.codec = "kivi4";
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport k4, refengine::RunDemo(o, {}));
  EXPECT_LE(Ratio(k4.sessions[0]), 0.15);
  // 4-bit keys and values: a larger but still small attention error.
  EXPECT_LT(std::sqrt(k4.sessions[0].err2 / k4.sessions[0].ref2), 0.1);
}

TEST_F(EngineDemoTest, RecallAllIsLosslessUpToFp16AndReportHasEveryKey) {
  refengine::DemoOptions o = Options();
  o.sessions = 2;
  o.rounds = 4;
  o.recall = "all";
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport r, refengine::RunDemo(o, {}));
  for (const refengine::DemoSession& s : r.sessions) {
    EXPECT_LT(std::sqrt(s.err2 / s.ref2), 2e-3);  // fp16 storage of past rounds.
    EXPECT_EQ(s.rounds.back().selected.size(), 3u);
  }
  const std::string json = refengine::RenderJson(r);
  for (const char* key :
       {"\"sessions\": 2", "\"rounds\": 4", "\"full_cache_bytes\": ", "\"working_set_bytes\": ",
        "\"working_set_ratio\": ", "\"store_bytes_ram\": ", "\"store_bytes_disk\": ",
        "\"recall_calls\": 6", "\"recall_rounds_selected\": 12",
        "\"decode_ms_per_token\": ", "\"attn_rel_err\": ", "\"top1_agreement\": null"}) {
    EXPECT_NE(json.find(key), std::string::npos) << key << " missing in\n" << json;
  }
  EXPECT_NE(refengine::RenderText(r).find("attention-output relative error"), std::string::npos);
  // Process memory beside the working sets: every EndRound reports the
  // worker's, Stats the store's; both are real figures of a live process.
  for (const refengine::DemoSession& s : r.sessions) {
    for (const refengine::TierRound& tr : s.rounds) {
      EXPECT_GT(tr.worker_memory.resident_bytes(), 1u << 20);
      EXPECT_GE(tr.worker_memory.peak_resident_bytes(), tr.worker_memory.resident_bytes());
#ifndef KVTIER_SANITIZED  // The sanitizers' allocator answers mallinfo2 with zeros.
      EXPECT_GT(tr.worker_memory.heap_in_use_bytes(), 0u);
#endif
    }
  }
  ASSERT_TRUE(r.store_memory.has_value());
  EXPECT_GT(r.store_memory->resident_bytes(), 1u << 20);
  EXPECT_NE(refengine::RenderText(r).find("kvtier-worker memory (largest worker): peak RSS"),
            std::string::npos);
  for (const char* key :
       {"\"worker_memory\": {\"resident_bytes\": ", "\"store_memory\": {\"resident_bytes\": ",
        "\"working_set_peak_sum_bytes\": "}) {
    EXPECT_NE(json.find(key), std::string::npos) << key << " missing in\n" << json;
  }
}

TEST_F(EngineDemoTest, BadPolicyTextsAreInvalidArgument) {
  refengine::DemoOptions o = Options();
  for (auto f : {+[](refengine::DemoOptions* x) { x->codec = "kivi3"; },
                 +[](refengine::DemoOptions* x) { x->recall = "top:3"; },
                 +[](refengine::DemoOptions* x) { x->evict = "snapkv"; },
                 +[](refengine::DemoOptions* x) { x->evict = "snapkv:64:zeta=1"; },
                 +[](refengine::DemoOptions* x) { x->sessions = 0; }}) {
    refengine::DemoOptions bad = o;
    f(&bad);
    EXPECT_THAT(refengine::RunDemo(bad, {}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  }
  o.evict = "snapkv:24:w=8";
  KVT_ASSERT_OK_AND_ASSIGN(v1::Policy p, refengine::DemoPolicy(o));
  EXPECT_EQ(p.eviction(), "snapkv");
  EXPECT_EQ(p.budget_tokens(), 24u);
  EXPECT_EQ(p.window(), 8u);
}

// The reference engine through the demo: lossless settings agree exactly;
// kivi8 with recall=all stays at the issue's >= 95% (measured 0.977 here).
TEST_F(EngineDemoTest, Stories260KThroughTheDemo) {
  KVT_REQUIRE_SHARED_MODEL(path);
  refengine::DemoOptions o = Options();
  o.model = path;
  o.sessions = 2;
  o.recall = "all";
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport lossless, refengine::RunDemo(o, {}));
  for (const refengine::DemoSession& s : lossless.sessions) {
    EXPECT_EQ(s.agreement.top1, 1.0);
    EXPECT_LT(s.agreement.max_logit_diff, 1e-3);
  }
  o.codec = "kivi8";
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport k8, refengine::RunDemo(o, {}));
  for (const refengine::DemoSession& s : k8.sessions) EXPECT_GE(s.agreement.top1, 0.95);
  EXPECT_NE(refengine::RenderJson(k8).find("\"attn_rel_err\": null"), std::string::npos);
}

// kvtier eval watershed on the synthetic chat finds the layer the demo uses
// (its queries turn topical at layer 7; layer 6 is already within 0.01
// nats), and above it 95% of the mass sits in a few rounds.
// The engine against a worker that serves TLS: with the workers' CA
// (kvtier-engine --worker_tls_root_certs) the demo runs; without it, it fails.
TEST(EngineDemoTlsTest, TheDemoReachesAWorkerServingTls) {
  testing::TempDir dir;
  auto certs = testing::MakeSelfSignedCert(dir.path());
  if (absl::IsUnavailable(certs.status())) GTEST_SKIP() << certs.status().message();
  ASSERT_TRUE(certs.ok()) << certs.status();
  const std::string &cert = certs->cert, &key = certs->key, &pem = certs->pem;
  testing::WorkerStack stack;
  testing::WorkerStackOptions so;
  so.worker_tls_cert = cert;
  so.worker_tls_key = key;
  KVT_ASSERT_OK(stack.Start(so));
  refengine::DemoOptions o;
  o.worker = stack.worker_target();
  o.store = stack.store()->target();
  o.sessions = 1;
  o.rounds = 2;
  o.worker_tls_root_certs = pem;
  o.worker_tls_server_name = "localhost";
  auto report = refengine::RunDemo(o, {});
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(report->sessions.size(), 1u);
  o.worker_tls_root_certs.clear();
  EXPECT_FALSE(refengine::RunDemo(o, {}).ok());
}

TEST(WatershedTest, SyntheticChatWatershedIsSix) {
  traces::SyntheticChatOptions o;
  const refengine::RoundDistributions d =
      refengine::SyntheticChatDistributions(traces::SyntheticChat(o));
  ASSERT_EQ(d.layers, 32);
  ASSERT_EQ(d.dist.size(), 22u);
  const refengine::WatershedReport w = refengine::AnalyzeWatershed(d);
  EXPECT_EQ(w.watershed, 6);
  EXPECT_GT(w.mean_kl[0], 10 * w.mean_kl[10]);
  EXPECT_LT(w.rounds_for_mass_mean[20], 3.0);
  EXPECT_GT(w.rounds_for_mass_mean[0], 8.0);
}

// The report explains a tier faster than its own full-cache reference, and
// only then.
TEST(DemoReportTest, SaysWhyTheTierBeatsTheFullCache) {
  refengine::DemoReport r;
  r.workload = "synthetic-chat";
  r.sessions.resize(1);
  r.sessions[0].decode_tokens = 10;
  r.sessions[0].tier_decode_ms = 10;
  r.sessions[0].local_decode_ms = 30;
  const std::string why = "(the full cache is the reference: fp32, every token";
  EXPECT_NE(refengine::RenderText(r).find(why), std::string::npos);
  r.sessions[0].tier_decode_ms = 60;
  EXPECT_EQ(refengine::RenderText(r).find(why), std::string::npos);
}

TEST(WatershedTest, RuleOnHandmadeDistributions) {
  refengine::RoundDistributions d;
  d.layers = 4;
  // Layer 0 uniform, layers 1-3 identical and concentrated: L_w = 1.
  d.dist.push_back({{0.25, 0.25, 0.25, 0.25},
                    {0.05, 0.05, 0.1, 0.8},
                    {0.05, 0.05, 0.1, 0.8},
                    {0.05, 0.05, 0.1, 0.8}});
  refengine::WatershedReport w = refengine::AnalyzeWatershed(d, 0.9);
  EXPECT_EQ(w.watershed, 1);
  EXPECT_DOUBLE_EQ(w.mean_kl[1], 0.0);
  EXPECT_EQ(w.rounds_for_mass_max[0], 4);
  EXPECT_EQ(w.rounds_for_mass_max[3], 2);
  // No layer agrees with the ones above it: no watershed.
  d.dist[0] = {
      {0.7, 0.1, 0.1, 0.1}, {0.1, 0.7, 0.1, 0.1}, {0.1, 0.1, 0.7, 0.1}, {0.1, 0.1, 0.1, 0.7}};
  EXPECT_EQ(refengine::AnalyzeWatershed(d).watershed, -1);
}

// Sliding layers: only the rounds still inside a later layer's window are
// at stake there. Layers 2 and 3 (window 16) attend rounds 0 and 1 that
// have left it; over rounds 2 and 3 they agree with layer 1, so L_w = 1.
// The same distributions read as global layers put it at 2.
TEST(WatershedTest, SlidingLayersCountOnlyTheRoundsInsideTheirWindow) {
  refengine::RoundDistributions d;
  d.layers = 4;
  d.dist.push_back({{0.25, 0.25, 0.25, 0.25},
                    {0.05, 0.05, 0.1, 0.8},
                    {0.5, 0.05, 0.05, 0.4},
                    {0.5, 0.05, 0.05, 0.4}});
  d.probe_round = {4};
  d.probe_pos = {41};
  d.round_end = {{10, 20, 30, 40}};  // Rounds 2 and 3 end after 41 - 16 + 1.
  d.window = {0, 0, 16, 16};
  refengine::WatershedReport w = refengine::AnalyzeWatershed(d);
  EXPECT_EQ(w.watershed, 1);
  EXPECT_NEAR(w.mean_kl[1], 0.0, 1e-12);
  EXPECT_GT(w.mean_kl[0], 0.1);
  EXPECT_EQ(w.at_stake_mean[1], 4.0);
  EXPECT_EQ(w.at_stake_mean[2], 2.0);
  d.window.clear();
  w = refengine::AnalyzeWatershed(d);
  EXPECT_EQ(w.watershed, 2);
  EXPECT_EQ(w.at_stake_mean[2], 4.0);
}

}  // namespace
}  // namespace kvtier
