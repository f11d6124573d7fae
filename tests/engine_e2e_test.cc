// End to end on stories260K: the reference engine in local mode (full cache)
// against tier mode (every layer's attention in kvtier-worker over gRPC,
// rounds kept in a real kvtier-store).
#include <cstdio>

#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "refengine/conversation.h"
#include "services/worker/worker_server.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"
#include "tests/util/worker_stack.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;

class EngineE2eTest : public ::testing::Test {
 protected:
  void Start() {
    KVT_ASSERT_OK(stack_.Start());
    channel_ = stack_.channel();
  }

  testing::WorkerStack stack_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(EngineE2eTest, Stories260KTierModeMatchesLocalMode) {
  KVT_REQUIRE_SHARED_MODEL(path);
  Start();
  KVT_ASSERT_OK_AND_ASSIGN(auto m, model::Model::Load(path));
  const int vocab = m->config().vocab_size;
  refengine::ConversationOptions o;
  o.rounds = 8;
  o.question_tokens = 10;
  o.answer_tokens = 12;
  auto local = refengine::LocalBackend(m->config());
  KVT_ASSERT_OK_AND_ASSIGN(refengine::Transcript truth,
                           refengine::RunConversation(*m, o, local.get(), nullptr, {}));

  // Lossless: raw fp32, no eviction, recall of every round.
  v1::Policy lossless;
  lossless.set_recall("all");
  lossless.set_release_after_end_round(true);
  KVT_ASSERT_OK_AND_ASSIGN(auto tier, refengine::TierBackend(refengine::SpecOf(m->config()),
                                                             channel_, "lossless", lossless));
  KVT_ASSERT_OK_AND_ASSIGN(refengine::Transcript got,
                           refengine::RunConversation(*m, o, tier.get(), nullptr, {}));
  EXPECT_EQ(got.answers, truth.answers) << "greedy tokens differ";
  const refengine::Agreement same = refengine::Compare(truth, got, vocab);
  EXPECT_LT(same.max_logit_diff, 1e-3);
  EXPECT_EQ(same.top1, 1.0);

  // Lossy settings, teacher-forced on the local transcript (same context).
  auto measure = [&](const std::string& name, v1::Codec codec, int bits,
                     const std::string& recall) {
    v1::Policy p;
    p.set_codec(codec);
    p.mutable_codec_params()->set_bits(bits);
    p.set_recall(recall);
    p.set_release_after_end_round(true);
    auto b = refengine::TierBackend(refengine::SpecOf(m->config()), channel_, name, p);
    EXPECT_TRUE(b.ok()) << b.status();
    auto t = refengine::RunConversation(*m, o, b->get(), &truth, {});
    EXPECT_TRUE(t.ok()) << t.status();
    const refengine::Agreement a = refengine::Compare(truth, *t, vocab);
    std::printf("%-20s top-1 agreement %.4f, KL %.5f nats\n", name.c_str(), a.top1, a.kl);
    return a;
  };
  // Floors: the measured values (deterministic for these seeds) minus a
  // margin of about 0.05 for kernel-order differences across machines.
  EXPECT_GE(measure("kivi8-all", v1::CODEC_KIVI, 8, "all").top1, 0.95);  // The target.
  EXPECT_GE(measure("raw-topk4", v1::CODEC_RAW, 0, "topk:4").top1, 0.75);
  EXPECT_GE(measure("kivi8-topk4", v1::CODEC_KIVI, 8, "topk:4").top1, 0.73);
  measure("kivi4-all", v1::CODEC_KIVI, 4, "all");
  measure("kivi2-all", v1::CODEC_KIVI, 2, "all");
}

}  // namespace
}  // namespace kvtier
