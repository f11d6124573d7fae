// Conversation replay (refengine/replay.h): the file format's precise
// errors, RunScript against the greedy conversation it generalizes, the
// sample file against a longhand full-cache replay, and the replay through a
// real kvtier-worker and kvtier-store with the report's figures.
#include "refengine/replay.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/store_client.h"
#include "gtest/gtest.h"
#include "model/export.h"
#include "refengine/demo.h"
#include "refengine/watershed.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"
#include "tests/util/worker_stack.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kGood[] =
    R"({"id": "a", "rounds": [{"user": [1, 2, 3], "assistant": [4, 5], "score": [[0, 2]]}]})";

TEST(ReplayFormatTest, ParsesRoundsScoresIdsAndSkipsBlankLines) {
  const std::string text = absl::StrCat(
      kGood, "\r\n\n   \n", R"({"rounds": [{"user": [7], "assistant": [8]}, {"user": [9, 10], )",
      R"("assistant": [11, 12, 13], "score": [[1, 2], [2, 3]]}]})", "\n");
  KVT_ASSERT_OK_AND_ASSIGN(auto cs, refengine::ParseConversations(text, "chats.jsonl"));
  ASSERT_EQ(cs.size(), 2u);
  EXPECT_EQ(cs[0].id, "a");
  EXPECT_EQ(cs[0].where, "chats.jsonl:1");
  EXPECT_EQ(cs[0].rounds[0].user, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(cs[0].rounds[0].score, (std::vector<std::pair<int, int>>{{0, 2}}));
  EXPECT_EQ(cs[1].id, "line-4");  // The default id names the line.
  EXPECT_EQ(cs[1].where, "chats.jsonl:4");
  EXPECT_EQ(cs[1].rounds[1].assistant, (std::vector<int>{11, 12, 13}));
  EXPECT_EQ(cs[1].rounds[1].score.size(), 2u);
  EXPECT_EQ(cs[1].tokens(), 7);
  // The writer's output parses back to the same conversations.
  KVT_ASSERT_OK_AND_ASSIGN(auto again, refengine::ParseConversations(refengine::ToJsonl(cs), "x"));
  ASSERT_EQ(again.size(), 2u);
  for (size_t i = 0; i < cs.size(); ++i) {
    EXPECT_EQ(again[i].id, cs[i].id);
    ASSERT_EQ(again[i].rounds.size(), cs[i].rounds.size());
    for (size_t r = 0; r < cs[i].rounds.size(); ++r) {
      EXPECT_EQ(again[i].rounds[r].user, cs[i].rounds[r].user);
      EXPECT_EQ(again[i].rounds[r].assistant, cs[i].rounds[r].assistant);
      EXPECT_EQ(again[i].rounds[r].score, cs[i].rounds[r].score);
    }
  }
  EXPECT_EQ(refengine::JsonQuote("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
}

// Each malformed line is refused with its line number and field, even
// after good lines (nothing is returned half-parsed).
TEST(ReplayFormatTest, MalformedLinesNameTheLineAndTheField) {
  const struct {
    const char* line;
    const char* message;
  } cases[] = {
      {"{\"rounds\": [", "f.jsonl:2: not a JSON object"},
      {"[1, 2]", "f.jsonl:2: not a JSON object"},
      {"{}", "f.jsonl:2: rounds: missing"},
      {R"({"rounds": []})", "f.jsonl:2: rounds: needs at least one round"},
      {R"({"rounds": {}})", "f.jsonl:2: rounds: expected an array, got an object"},
      {R"({"rounds": [[1]]})", "f.jsonl:2: rounds[0]: expected an object"},
      {R"({"rounds": [{"user": [1]}]})", "f.jsonl:2: rounds[0]: missing \"assistant\""},
      {R"({"rounds": [{"user": [1], "assistant": [2]}, {"user": [], "assistant": [2]}]})",
       "f.jsonl:2: rounds[1].user: needs at least one token id"},
      {R"({"rounds": [{"user": [1], "assistant": [2, 3, -1]}]})",
       "f.jsonl:2: rounds[0].assistant[2]: expected a token id (an integer >= 0), got -1"},
      {R"({"rounds": [{"user": [1.5], "assistant": [2]}]})",
       "f.jsonl:2: rounds[0].user[0]: expected a token id (an integer >= 0), got 1.5"},
      {R"({"rounds": [{"user": ["7"], "assistant": [2]}]})",
       "f.jsonl:2: rounds[0].user[0]: expected a token id (an integer >= 0), got a string"},
      {R"({"rounds": [{"user": [1], "asistant": [2]}]})",
       "f.jsonl:2: rounds[0]: unknown key \"asistant\""},
      {R"({"rounds": [{"user": [1], "assistant": [2]}], "title": "x"})",
       "f.jsonl:2: \"title\": unknown key"},
      {R"({"id": 3, "rounds": [{"user": [1], "assistant": [2]}]})",
       "f.jsonl:2: id: expected a non-empty string, got a number"},
      {R"({"rounds": [{"user": [1], "assistant": [2, 3], "score": [[1, 3]]}]})",
       "f.jsonl:2: rounds[0].score[0]: [1, 3) is not a non-empty span of the round's 2 "
       "assistant tokens"},
      {R"({"rounds": [{"user": [1], "assistant": [2, 3], "score": [[1]]}]})",
       "f.jsonl:2: rounds[0].score[0]: expected [begin, end], got 1 numbers"},
      {R"({"rounds": [{"user": [1], "assistant": [2, 3], "score": [2]}]})",
       "f.jsonl:2: rounds[0].score[0]: expected an array, got a number"},
  };
  for (const auto& c : cases) {
    const std::string text = absl::StrCat(kGood, "\n", c.line, "\n", kGood, "\n");
    auto r = refengine::ParseConversations(text, "f.jsonl");
    EXPECT_THAT(r.status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.line;
  }
  EXPECT_THAT(
      refengine::ParseConversations("\n\n", "empty.jsonl").status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty.jsonl: no conversation")));
  EXPECT_THAT(refengine::LoadConversations("/nonexistent/chats.jsonl").status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/chats.jsonl")));
}

TEST(ReplayFormatTest, ConversationsMustFitTheModel) {
  model::ModelConfig c;
  c.vocab_size = 10;
  c.seq_len = 8;
  KVT_ASSERT_OK_AND_ASSIGN(auto ok, refengine::ParseConversations(kGood, "f"));
  KVT_ASSERT_OK(refengine::CheckConversations(ok, c));
  KVT_ASSERT_OK_AND_ASSIGN(
      auto vocab,
      refengine::ParseConversations(
          absl::StrCat(kGood, "\n", R"({"rounds": [{"user": [1], "assistant": [2, 10]}]})"), "f"));
  EXPECT_THAT(refengine::CheckConversations(vocab, c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("f:2: rounds[0].assistant[1]: token 10 is outside the model's "
                                 "vocabulary [0, 10)")));
  KVT_ASSERT_OK_AND_ASSIGN(
      auto longer,
      refengine::ParseConversations(
          R"({"id": "long", "rounds": [{"user": [1, 2, 3, 4, 5], "assistant": [1, 2, 3, 4]}]})",
          "f"));
  EXPECT_THAT(refengine::CheckConversations(longer, c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("f:1: conversation \"long\" holds 9 tokens, more than the "
                                 "model's context of 8")));
}

// RunScript on the full cache, given the questions and greedy answers of
// RunConversation, reproduces its logits bit for bit: the scripted rounds
// are the same computation with the answers given instead of chosen.
TEST(ReplayModelTest, ScriptOfAGreedyConversationReproducesIt) {
  KVT_REQUIRE_SHARED_MODEL(path);
  KVT_ASSERT_OK_AND_ASSIGN(auto m, model::Model::Load(path));
  refengine::ConversationOptions o;
  o.rounds = 6;
  o.question_tokens = 9;
  o.answer_tokens = 7;
  auto local = refengine::LocalBackend(m->config());
  KVT_ASSERT_OK_AND_ASSIGN(refengine::Transcript greedy,
                           refengine::RunConversation(*m, o, local.get(), nullptr, nullptr));
  std::vector<refengine::ScriptRound> script;
  for (int r = 0; r < o.rounds; ++r) script.push_back({greedy.questions[r], greedy.answers[r]});
  auto again = refengine::LocalBackend(m->config());
  KVT_ASSERT_OK_AND_ASSIGN(refengine::Transcript t,
                           refengine::RunScript(*m, script, again.get(), nullptr));
  ASSERT_EQ(t.logits.size(), greedy.logits.size());
  for (int r = 0; r < o.rounds; ++r) EXPECT_EQ(t.logits[r], greedy.logits[r]) << "round " << r;
  // Out-of-vocabulary tokens and an empty round are refused before any step.
  script[2].assistant[0] = m->config().vocab_size;
  EXPECT_THAT(refengine::RunScript(*m, script, again.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("round 2: token")));
  script[2].assistant.clear();
  EXPECT_THAT(refengine::RunScript(*m, script, again.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("round 2")));
}

// The sample file fits the model, every conversation refers back to earlier
// rounds, and a longhand replay on the full cache (token by token, Step
// after Step) predicts every scored token: the spans are what the full
// cache answers, as the generator says.
TEST(ReplayModelTest, SampleFileIsWhatTheFullCacheAnswers) {
  KVT_REQUIRE_SHARED_MODEL(path);
  KVT_ASSERT_OK_AND_ASSIGN(auto m, model::Model::Load(path));
  KVT_ASSERT_OK_AND_ASSIGN(
      auto cs, refengine::LoadConversations(testing::SourcePath("traces/stories260k_chats.jsonl")));
  ASSERT_EQ(cs.size(), 4u);
  KVT_ASSERT_OK(refengine::CheckConversations(cs, m->config()));
  const int vocab = m->config().vocab_size;
  for (const refengine::ReplayConversation& c : cs) {
    EXPECT_GE(c.rounds.size(), 10u) << c.id;
    model::FullCacheAttention cache(m->config());
    model::Forward f(*m);
    std::vector<float> logits(vocab);
    int pos = 0, scored = 0, correct = 0;
    for (const refengine::ReplayRound& r : c.rounds) {
      for (int t : r.user) KVT_ASSERT_OK(f.Step(t, pos++, &cache, logits.data()));
      std::vector<bool> in_span(r.assistant.size());
      for (const auto& [b, e] : r.score) {
        for (int i = b; i < e; ++i) in_span[i] = true;
      }
      for (size_t i = 0; i < r.assistant.size(); ++i) {
        if (in_span[i]) {
          ++scored;
          correct += model::Argmax(logits.data(), vocab) == r.assistant[i];
        }
        KVT_ASSERT_OK(f.Step(r.assistant[i], pos++, &cache, logits.data()));
      }
    }
    EXPECT_GT(scored, 20) << c.id;
    EXPECT_EQ(correct, scored) << c.id;
  }
  // The watershed analysis takes the same file: one probe per round with
  // two or more past rounds, each a distribution over the past rounds.
  KVT_ASSERT_OK_AND_ASSIGN(refengine::RoundDistributions d, refengine::ReplayDistributions(*m, cs));
  size_t probes = 0;
  for (const auto& c : cs) probes += c.rounds.size() - 2;
  ASSERT_EQ(d.dist.size(), probes);
  for (size_t p = 0; p < d.dist.size(); ++p) {
    ASSERT_EQ(d.dist[p].size(), static_cast<size_t>(m->config().n_layers));
    EXPECT_EQ(d.dist[p][0].size(), static_cast<size_t>(d.probe_round[p]));
    double sum = 0;
    for (double x : d.dist[p].back()) sum += x;
    EXPECT_NEAR(sum, 1.0, 1e-6);
  }
}

class ReplayDemoTest : public ::testing::Test {
 protected:
  void SetUp() override { KVT_ASSERT_OK(stack_.Start()); }

  refengine::DemoOptions Options(const std::string& model) {
    refengine::DemoOptions o;
    o.worker = stack_.worker_target();
    o.store = stack_.store()->target();
    o.model = model;
    o.conversations = testing::SourcePath("traces/stories260k_chats.jsonl");
    o.sessions = 2;  // Of the file's 4 conversations, 2 at a time.
    return o;
  }

  uint64_t StoreSessions() {
    StoreClientOptions so;
    so.target = stack_.store()->target();
    auto client = StoreClient::Connect(so);
    if (!client.ok()) return ~uint64_t{0};
    auto st = (*client)->Stats();
    return st.ok() ? st->sessions() : ~uint64_t{0};
  }

  testing::WorkerStack stack_;
};

// Through kvtier-worker with every round recalled and lossless storage, the
// tier answers exactly as the full cache; with kivi2 it does not, and the
// report says by how much on the scored spans.
TEST_F(ReplayDemoTest, SampleFileThroughTheWorker) {
  KVT_REQUIRE_SHARED_MODEL(path);
  refengine::DemoOptions o = Options(path);
  o.recall = "all";
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport lossless, refengine::RunDemo(o, {}));
  KVT_ASSERT_OK_AND_ASSIGN(
      auto cs, refengine::LoadConversations(testing::SourcePath("traces/stories260k_chats.jsonl")));
  ASSERT_EQ(lossless.sessions.size(), cs.size());
  int scored = 0, agree = 0, positions = 0, tier_correct = 0;
  for (size_t i = 0; i < cs.size(); ++i) {
    const refengine::DemoSession& s = lossless.sessions[i];
    EXPECT_EQ(s.conversation, cs[i].id);
    ASSERT_EQ(s.replay.size(), cs[i].rounds.size());
    ASSERT_EQ(s.rounds.size(), cs[i].rounds.size());
    for (size_t r = 0; r < s.replay.size(); ++r) {
      const refengine::ReplayRoundScore& x = s.replay[r];
      EXPECT_EQ(x.user_tokens, static_cast<int>(cs[i].rounds[r].user.size()));
      EXPECT_EQ(x.assistant_tokens, static_cast<int>(cs[i].rounds[r].assistant.size()));
      EXPECT_EQ(x.local_correct, x.scored);
      agree += x.top1_agree;
      positions += x.assistant_tokens;
      tier_correct += x.tier_correct;
      scored += x.scored;
      if (r > 0) {
        EXPECT_EQ(s.rounds[r].selected.size(), r);  // recall=all.
      }
    }
    EXPECT_LT(s.agreement.max_logit_diff, 1e-3);
  }
  EXPECT_GT(scored, 100);
  // The worker sums in another order than the full cache: logits agree to
  // 1e-3, and a position whose two best tokens are closer than that may
  // flip (the sampled text has a few; the scored spans have none).
  EXPECT_GE(agree, positions - 3) << agree << " of " << positions;
  EXPECT_EQ(tier_correct, scored);
  const std::string text = refengine::RenderText(lossless);
  EXPECT_THAT(text, HasSubstr("4 conversations replayed from"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("accuracy on the scored spans (", scored,
                                           " tokens): kvtier 1.000, full cache 1.000")));
  const std::string json = refengine::RenderJson(lossless);
  for (const char* key : {"\"replay\": {\"file\": ", "\"conversations\": 4",
                          "\"scored_accuracy_tier\": 1,", "\"scored_accuracy_full_cache\": 1}",
                          "\"replay_rounds\": [", "\"bytes_fetched\": ", "\"recalled\": [0]"}) {
    EXPECT_THAT(json, HasSubstr(key));
  }

  o.codec = "kivi2";
  o.recall = "mass:0.95";
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport k2, refengine::RunDemo(o, {}));
  int tier = 0, local = 0, n = 0;
  for (const refengine::DemoSession& s : k2.sessions) {
    for (const refengine::ReplayRoundScore& x : s.replay) {
      tier += x.tier_correct;
      local += x.local_correct;
      n += x.scored;
    }
  }
  EXPECT_EQ(n, scored);
  EXPECT_EQ(local, n);  // The full cache is the same run whatever the tier does.
  EXPECT_LT(tier, n * 9 / 10);
  EXPECT_EQ(StoreSessions(), 0u);  // The demo deletes its sessions at the end.
  // A policy that changes the answers says so; a lossless one does not.
  EXPECT_THAT(text, ::testing::Not(HasSubstr("warning: top-1 agreement")));
  EXPECT_THAT(refengine::RenderText(k2), HasSubstr("warning: top-1 agreement 0."));
}

// With a teacher cache, the first replay computes the full cache and keeps
// its logits; the second reads them and scores every round exactly as the
// first did; a copy of the model file is another identity and computes again.
TEST_F(ReplayDemoTest, TeacherCacheScoresAsTheFullCacheDid) {
  KVT_REQUIRE_SHARED_MODEL(path);
  testing::TempDir dir;
  refengine::DemoOptions o = Options(path);
  o.codec = "kivi2";
  o.recall = "mass:0.95";
  o.teacher_cache = dir.path() + "/teachers";
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport first, refengine::RunDemo(o, {}));
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport second, refengine::RunDemo(o, {}));
  ASSERT_EQ(first.sessions.size(), 4u);
  ASSERT_EQ(second.sessions.size(), 4u);
  for (size_t i = 0; i < first.sessions.size(); ++i) {
    const refengine::DemoSession& a = first.sessions[i];
    const refengine::DemoSession& b = second.sessions[i];
    EXPECT_FALSE(a.teacher_cached);
    EXPECT_TRUE(b.teacher_cached);
    EXPECT_EQ(b.local_decode_ms, a.local_decode_ms);  // The time measured when written.
    EXPECT_EQ(b.agreement.top1, a.agreement.top1);
    EXPECT_EQ(b.agreement.kl, a.agreement.kl);
    ASSERT_EQ(a.replay.size(), b.replay.size());
    for (size_t r = 0; r < a.replay.size(); ++r) {
      EXPECT_EQ(a.replay[r].local_tokens, b.replay[r].local_tokens) << i << " round " << r;
      EXPECT_EQ(a.replay[r].local_correct, b.replay[r].local_correct);
      EXPECT_EQ(a.replay[r].kl_sum, b.replay[r].kl_sum) << i << " round " << r;
    }
  }
  EXPECT_THAT(refengine::RenderText(second),
              HasSubstr("full cache: read from --teacher_cache for 4 of 4 conversations"));
  EXPECT_THAT(refengine::RenderJson(second), HasSubstr("\"teacher_cached\": true"));
  EXPECT_THAT(refengine::RenderText(first), ::testing::Not(HasSubstr("--teacher_cache")));

  const std::string copy = dir.path() + "/copy.bin";
  std::filesystem::copy_file(path, copy);
  o.model = copy;
  o.sessions = 4;
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport other, refengine::RunDemo(o, {}));
  for (const refengine::DemoSession& s : other.sessions) EXPECT_FALSE(s.teacher_cached);

  o.conversations.clear();
  EXPECT_THAT(refengine::RunDemo(o, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs --conversations")));
}

// In-process mode (the worker engine inside the engine, the store remote):
// the same answers and the same stored rounds as through kvtier-worker, and
// kivi2 with mass recall reports the same scored accuracy, bit for bit the
// same encoded rounds.
TEST_F(ReplayDemoTest, SampleFileInProcess) {
  KVT_REQUIRE_SHARED_MODEL(path);
  refengine::DemoOptions o = Options(path);
  o.codec = "kivi2";
  o.recall = "mass:0.95";
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport remote, refengine::RunDemo(o, {}));
  o.worker.clear();
  o.inproc = true;
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport inproc, refengine::RunDemo(o, {}));
  ASSERT_EQ(inproc.sessions.size(), remote.sessions.size());
  int scored = 0;
  for (size_t i = 0; i < remote.sessions.size(); ++i) {
    const refengine::DemoSession& a = remote.sessions[i];
    const refengine::DemoSession& b = inproc.sessions[i];
    ASSERT_EQ(a.rounds.size(), b.rounds.size());
    for (size_t r = 0; r < a.rounds.size(); ++r) {
      EXPECT_EQ(a.rounds[r].selected, b.rounds[r].selected) << i << " round " << r;
      EXPECT_EQ(a.rounds[r].stored_bytes, b.rounds[r].stored_bytes) << i << " round " << r;
      EXPECT_EQ(a.rounds[r].round_working_set_bytes, b.rounds[r].round_working_set_bytes);
      EXPECT_EQ(a.replay[r].tier_correct, b.replay[r].tier_correct) << i << " round " << r;
      scored += b.replay[r].scored;
    }
  }
  EXPECT_EQ(scored, 308);
  EXPECT_THAT(refengine::RenderText(inproc),
              HasSubstr("with the worker engine in this process (the store remote)"));
  EXPECT_THAT(refengine::RenderJson(inproc), HasSubstr("\"mode\": \"inproc\""));
  EXPECT_EQ(StoreSessions(), 0u);
  o.store.clear();
  EXPECT_THAT(refengine::RunDemo(o, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--store")));
}

// A model with sliding-window layers (stories260K's weights in gemma3's
// shape: windows of 32 tokens on layers 0, 2 and 4) through kvtier-worker
// and in process, every round recalled and stored losslessly: the tier
// answers as the full cache, which attends within the windows. A worker
// that ignored the windows would not (the conversations run to 400 tokens).
TEST_F(ReplayDemoTest, SlidingWindowModelThroughTheWorker) {
  KVT_REQUIRE_SHARED_MODEL(path);
  KVT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Model> bin, model::Model::Load(path));
  testing::TempDir dir;
  model::ExportOptions e;
  e.arch = "gemma3";
  e.gemma3_window = 32;
  e.gemma3_global_every = 2;
  const std::string windowed = dir.path() + "/w32.gguf";
  ASSERT_TRUE(model::ExportGguf(*bin, e, windowed).ok());
  refengine::DemoOptions o = Options(windowed);
  o.recall = "all";
  // The same weights with windows that never bite, for the working set.
  e.gemma3_window = 4096;
  const std::string wide = dir.path() + "/wide.gguf";
  ASSERT_TRUE(model::ExportGguf(*bin, e, wide).ok());
  refengine::DemoOptions ow = Options(wide);
  ow.recall = "all";
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport rw, refengine::RunDemo(ow, {}));
  for (bool inproc : {false, true}) {
    SCOPED_TRACE(inproc ? "in process" : "through kvtier-worker");
    if (inproc) {
      o.worker.clear();
      o.inproc = true;
    }
    KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport r, refengine::RunDemo(o, {}));
    int positions = 0, agree = 0;
    ASSERT_EQ(r.sessions.size(), rw.sessions.size());
    for (size_t i = 0; i < r.sessions.size(); ++i) {
      const refengine::DemoSession& s = r.sessions[i];
      EXPECT_LT(s.agreement.max_logit_diff, 1e-3) << s.conversation;
      // Rounds that left layer 0's window leave the working set there
      // (the store keeps them): at the last round it is smaller than with
      // windows that never bite, at every round no larger.
      ASSERT_EQ(s.rounds.size(), rw.sessions[i].rounds.size());
      for (size_t j = 0; j < s.rounds.size(); ++j) {
        EXPECT_LE(s.rounds[j].round_working_set_bytes,
                  rw.sessions[i].rounds[j].round_working_set_bytes);
      }
      EXPECT_LT(s.rounds.back().round_working_set_bytes,
                rw.sessions[i].rounds.back().round_working_set_bytes)
          << s.conversation;
      for (const refengine::ReplayRoundScore& x : s.replay) {
        positions += x.assistant_tokens;
        agree += x.top1_agree;
      }
    }
    EXPECT_GT(positions, 100);
    EXPECT_GE(agree, positions - 3);
  }
  // Eviction evicts at the global layers only (a sliding layer keeps its
  // window whole): the answers stay close to the full cache's and the
  // working set shrinks below the lossless run's.
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport lossless, refengine::RunDemo(o, {}));
  o.evict = "snapkv:16";
  KVT_ASSERT_OK_AND_ASSIGN(refengine::DemoReport evicted, refengine::RunDemo(o, {}));
  ASSERT_EQ(evicted.sessions.size(), lossless.sessions.size());
  for (size_t i = 0; i < evicted.sessions.size(); ++i) {
    EXPECT_LT(evicted.sessions[i].rounds.back().round_working_set_bytes,
              lossless.sessions[i].rounds.back().round_working_set_bytes);
    EXPECT_GT(evicted.sessions[i].agreement.top1, 0.5);
  }
  EXPECT_EQ(StoreSessions(), 0u);
}

// A bad file runs nothing: the error names its line, and no session reached
// the worker or the store.
TEST_F(ReplayDemoTest, BadFilesRunNothing) {
  KVT_REQUIRE_SHARED_MODEL(path);
  testing::TempDir dir;
  const std::string file = dir.path() + "/chats.jsonl";
  {
    std::ofstream f(file);
    f << kGood << "\n"
      << kGood << "\n"
      << R"({"rounds": [{"user": [1], "assistant": [600]}]})"
      << "\n";
  }
  refengine::DemoOptions o = Options(path);
  o.conversations = file;
  o.delete_at_end = false;
  EXPECT_THAT(refengine::RunDemo(o, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat(file, ":3: rounds[0].assistant[0]: token 600"))));
  {
    std::ofstream f(file);
    f << kGood << "\n{\"rounds\": [{\"user\": [1], \"assistant\": [2]}\n";
  }
  EXPECT_THAT(refengine::RunDemo(o, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(absl::StrCat(file, ":2: "))));
  EXPECT_EQ(StoreSessions(), 0u);
  o.model.clear();
  EXPECT_THAT(refengine::RunDemo(o, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--model")));
}

}  // namespace
}  // namespace kvtier
