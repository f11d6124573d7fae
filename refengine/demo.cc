#include "refengine/demo.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "client/store_client.h"
#include "client/store_segments.h"
#include "encoded/encode.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "kernels/codec.h"
#include "kernels/crc32c.h"
#include "kernels/recall.h"
#include "kernels/speculation.h"
#include "refengine/inproc.h"
#include "refengine/teacher_cache.h"
#include "rpc/transport_args.h"
#include "traces/synthetic_chat.h"
#include "worker/engine.h"
#include "worker/round_layout.h"

namespace kvtier::refengine {
namespace {

// The engine's store client: --store, its token and TLS.
StoreClientOptions StoreOptionsOf(const DemoOptions& o) {
  StoreClientOptions so;
  so.target = o.store;
  so.token = o.token;
  so.tls_root_certs = o.store_tls_root_certs;
  if (!so.tls_root_certs.empty()) {
    so.tls_cert_chain = o.tls_cert_chain;
    so.tls_private_key = o.tls_private_key;
  }
  return so;
}

// The synthetic chat's watershed layer as `kvtier eval watershed` measures
// it (the first layer whose round distribution stays within 0.01 nats of
// every later layer's).
constexpr int kSyntheticWatershed = 6;
// A model's round: 24 rounds of 10 + 11 tokens fill stories260K's context.
constexpr int kModelQuestionTokens = 10;
constexpr int kModelAnswerTokens = 11;

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// Opens a session's tier backend: on the demo's worker, or routed through
// the cluster's controller.
using OpenTier =
    std::function<absl::StatusOr<std::unique_ptr<TierSession>>(const v1::ModelSpec&, DemoSession*)>;

absl::Status RunSynthetic(const DemoOptions& o, const OpenTier& open, int index, DemoSession* out,
                          std::unique_ptr<TierSession>* session,
                          const std::function<void(const std::string&)>& progress) {
  traces::SyntheticChatOptions co;
  co.rounds = o.rounds;
  if (o.question_tokens > 0) co.question_tokens = o.question_tokens;
  if (o.answer_tokens > 0) co.answer_tokens = o.answer_tokens;
  co.seed = o.seed * 1000 + static_cast<uint64_t>(index);
  KVT_RETURN_IF_ERROR(traces::ValidateSyntheticChat(co));
  const traces::SyntheticChat chat(co);
  const int per = chat.tokens_per_round(), d = co.head_dim;
  model::ModelConfig lc;
  lc.n_layers = co.layers;
  lc.n_heads = co.q_heads;
  lc.n_kv_heads = co.kv_heads;
  lc.dim = co.q_heads * d;
  lc.seq_len = co.rounds * per;
  auto local = LocalBackend(lc);
  v1::ModelSpec spec;
  spec.set_num_layers(co.layers);
  spec.set_num_q_heads(co.q_heads);
  spec.set_num_kv_heads(co.kv_heads);
  spec.set_head_dim(d);
  spec.set_dtype(v1::DTYPE_FP16);
  KVT_ASSIGN_OR_RETURN(*session, open(spec, out));
  TierSession* tier = session->get();
  const size_t qrow = static_cast<size_t>(co.q_heads) * d,
               kvrow = static_cast<size_t>(co.kv_heads) * d;
  // Every layer's q/k/v of one step, generated once for both backends.
  const size_t qn = co.question_tokens * qrow, kvn = co.question_tokens * kvrow;
  std::vector<float> q(co.layers * qn), k(co.layers * kvn), v(co.layers * kvn), o_local(qn);
  int pos = 0;
  std::vector<float> o_all(static_cast<size_t>(co.layers) * qn);
  // One step: n tokens starting at `first` of round r, through every layer
  // of the tier, then of the local cache (the inputs do not depend on the
  // outputs, so a tier failure leaves the local cache untouched). A step
  // sent again after a failover (`replay`) skips the local cache.
  auto step = [&](int r, int first, int n, bool replay, double* tier_ms,
                  double* local_ms) -> absl::Status {
    const bool prefill = first == 0;
    for (int l = 0; l < co.layers; ++l) {
      for (int i = 0; i < n; ++i) {
        chat.Token(r, first + i, l, &q[l * qn + i * qrow], &k[l * kvn + i * kvrow],
                   &v[l * kvn + i * kvrow]);
      }
    }
    auto t0 = Clock::now();
    KVT_RETURN_IF_ERROR(tier->BeginStep(prefill, n, co.question_tokens));
    for (int l = 0; l < co.layers; ++l) {
      KVT_RETURN_IF_ERROR(tier->AttendLayer(l, pos, n, &q[l * qn], &k[l * kvn], &v[l * kvn],
                                            o_all.data() + l * qn));
    }
    KVT_RETURN_IF_ERROR(tier->EndStep());
    const double tms = MsSince(t0);
    if (!replay) {
      double lms = 0;
      KVT_RETURN_IF_ERROR(local->BeginStep(prefill, n, co.question_tokens));
      for (int l = 0; l < co.layers; ++l) {
        t0 = Clock::now();
        KVT_RETURN_IF_ERROR(
            local->AttendLayer(l, pos, n, &q[l * qn], &k[l * kvn], &v[l * kvn], o_local.data()));
        lms += MsSince(t0);
        const float* o_tier_l = o_all.data() + l * qn;
        for (size_t j = 0; j < n * qrow; ++j) {
          const double e = static_cast<double>(o_tier_l[j]) - o_local[j];
          out->err2 += e * e;
          out->ref2 += static_cast<double>(o_local[j]) * o_local[j];
        }
      }
      KVT_RETURN_IF_ERROR(local->EndStep());
      if (local_ms != nullptr) *local_ms += lms;
      for (int l = 0; l < co.layers; ++l) {
        out->outputs_crc32c =
            Crc32cExtend(out->outputs_crc32c, o_all.data() + l * qn, n * qrow * sizeof(float));
      }
    }
    pos += n;
    if (tier_ms != nullptr) *tier_ms += tms;
    return absl::OkStatus();
  };
  const int steps_per_round = 1 + co.answer_tokens;
  for (int r = 0; r < co.rounds; ++r) {
    const int round_pos = pos;
    int done = 0;  // Steps of this round the local cache has taken.
    for (int tries = 0;; ++tries) {
      pos = round_pos;
      absl::Status s = [&]() -> absl::Status {
        for (int i = 0; i < steps_per_round; ++i) {
          const bool replay = i < done;
          if (i == 0) {
            KVT_RETURN_IF_ERROR(step(r, 0, co.question_tokens, replay, nullptr, nullptr));
          } else {
            KVT_RETURN_IF_ERROR(step(r, co.question_tokens + i - 1, 1, replay,
                                     replay ? nullptr : &out->tier_decode_ms,
                                     &out->local_decode_ms));
            if (!replay) ++out->decode_tokens;
          }
          if (!replay) ++done;
        }
        return tier->EndRound();
      }();
      if (s.ok()) break;
      if (tries == 3) return s;
      KVT_ASSIGN_OR_RETURN(uint32_t next, tier->Recover(static_cast<uint32_t>(r), s));
      if (progress) {
        progress(absl::StrCat(
            out->id, " round ", r, " (", r + 1, " of ", co.rounds, "): ", s.message(), "; ",
            next == static_cast<uint32_t>(r) ? "sending the round again" : "the round was stored"));
      }
      if (next == static_cast<uint32_t>(r) + 1) break;
    }
    KVT_RETURN_IF_ERROR(local->EndRound());
    out->references.push_back(chat.References(r));
    if (progress && !tier->rounds().empty()) {
      const TierRound& tr = tier->rounds().back();
      progress(
          absl::StrCat(out->id, " round ", r, " (", r + 1, " of ", co.rounds, "): refers to [",
                       absl::StrJoin(chat.References(r), " "), "], recalled [",
                       absl::StrJoin(tr.selected, " "), "], working set ",
                       absl::StrFormat("%.2f", static_cast<double>(tr.round_working_set_bytes) /
                                                   std::max<uint64_t>(1, tr.full_cache_bytes)),
                       " of the full cache"));
    }
  }
  out->rounds = tier->rounds();
  out->on_device = tier->on_device();
  out->speculation_on_device = tier->speculation_on_device();
  return absl::OkStatus();
}

absl::Status RunModel(const DemoOptions& o, const model::Model& m, const OpenTier& open, int index,
                      DemoSession* out, std::unique_ptr<TierSession>* session,
                      const std::function<void(const std::string&)>& progress) {
  ConversationOptions co;
  co.rounds = o.rounds;
  co.question_tokens = o.question_tokens > 0 ? o.question_tokens : kModelQuestionTokens;
  co.answer_tokens = o.answer_tokens > 0 ? o.answer_tokens : kModelAnswerTokens;
  co.seed = o.seed * 1000 + static_cast<uint64_t>(index);
  auto local = LocalBackend(m.config());
  KVT_ASSIGN_OR_RETURN(Transcript teacher, RunConversation(m, co, local.get(), nullptr, nullptr));
  KVT_ASSIGN_OR_RETURN(*session, open(SpecOf(m.config()), out));
  TierSession* tier = session->get();
  auto line = [&](const std::string& s) {
    if (progress) progress(absl::StrCat(out->id, " ", s));
  };
  KVT_ASSIGN_OR_RETURN(Transcript t, RunConversation(m, co, tier, &teacher, line));
  out->agreement = Compare(teacher, t, m.config().vocab_size);
  out->decode_tokens = static_cast<int64_t>(co.rounds) * co.answer_tokens;
  out->tier_decode_ms = t.decode_ms_per_token * out->decode_tokens;
  out->local_decode_ms = teacher.decode_ms_per_token * out->decode_tokens;
  out->rounds = tier->rounds();
  out->on_device = tier->on_device();
  out->speculation_on_device = tier->speculation_on_device();
  return absl::OkStatus();
}

// The full cache's rounds of logits, handed from its thread to the tier's
// scoring as each round completes. At most kAhead rounds wait, so neither
// side holds a conversation's logits (Gemma 3's are 1 MiB a position).
class RoundHandover {
 public:
  static constexpr size_t kAhead = 2;
  // The full cache's side: blocks while kAhead rounds wait; CANCELLED once
  // the tier's side has given up.
  absl::Status Put(int round, std::vector<float> logits) {
    absl::MutexLock lock(&mu_);
    while (waiting_.size() >= kAhead && !cancelled_) cv_.Wait(&mu_);
    if (cancelled_) return absl::CancelledError("the tier's run of the conversation ended");
    waiting_.emplace(round, std::move(logits));
    cv_.SignalAll();
    return absl::OkStatus();
  }
  // The full cache's run ended with `status`.
  void Finish(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    finished_ = true;
    status_ = status;
    cv_.SignalAll();
  }
  // The tier's side: round `round`'s logits once they come; the full
  // cache's error if its run ended without them.
  absl::StatusOr<std::vector<float>> Take(int round) {
    absl::MutexLock lock(&mu_);
    while (waiting_.count(round) == 0 && !finished_) cv_.Wait(&mu_);
    auto it = waiting_.find(round);
    if (it == waiting_.end()) {
      if (!status_.ok()) return status_;
      return absl::InternalError(absl::StrCat("the full cache's run ended before round ", round));
    }
    std::vector<float> out = std::move(it->second);
    waiting_.erase(it);
    cv_.SignalAll();
    return out;
  }
  void Cancel() {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    cv_.SignalAll();
  }

 private:
  absl::Mutex mu_;
  absl::CondVar cv_;
  std::map<int, std::vector<float>> waiting_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// A conversation from the user's file: teacher-forced on its assistant
// tokens through the full cache and through the tier at once, scored a
// round at a time as both have it.
// With `cache`, the full cache's logits are read from it when it has the
// conversation and written to it when not.
absl::Status RunReplayed(const model::Model& m, const ReplayConversation& c, const OpenTier& open,
                         const ScriptOptions& options, const TeacherCache* cache, DemoSession* out,
                         std::unique_ptr<TierSession>* session,
                         const std::function<void(const std::string&)>& progress) {
  out->conversation = c.id;
  out->where = c.where;
  const std::vector<ScriptRound> script = c.Script();
  const int vocab = m.config().vocab_size;
  std::optional<TeacherCache::Reader> cached;
  std::optional<TeacherCache::Writer> writer;
  if (cache != nullptr) {
    KVT_ASSIGN_OR_RETURN(cached, cache->Find(script, options, vocab));
    if (!cached.has_value()) {
      KVT_ASSIGN_OR_RETURN(TeacherCache::Writer w, cache->Create(script, options, vocab));
      writer.emplace(std::move(w));
    }
  }
  out->teacher_cached = cached.has_value();
  auto local = LocalBackend(m.config());
  RoundHandover handover;
  absl::StatusOr<Transcript> teacher = absl::UnknownError("the full cache did not run");
  std::thread full([&] {
    if (cached.has_value()) {
      Transcript t;
      t.decode_ms_per_token = cached->decode_ms_per_token();
      teacher = std::move(t);
      for (int r = 0; r < static_cast<int>(script.size()) && teacher.ok(); ++r) {
        absl::StatusOr<std::vector<float>> logits = cached->Round(r);
        absl::Status put = logits.ok() ? handover.Put(r, *std::move(logits)) : logits.status();
        if (!put.ok()) teacher = put;
      }
    } else {
      teacher = RunScript(
          m, script, local.get(), nullptr,
          [&](int r, std::vector<float> logits) {
            if (writer.has_value()) KVT_RETURN_IF_ERROR(writer->Append(r, logits));
            return handover.Put(r, std::move(logits));
          },
          options);
      if (teacher.ok() && writer.has_value()) {
        absl::Status s = writer->Commit(teacher->decode_ms_per_token);
        if (!s.ok()) teacher = s;
      }
    }
    handover.Finish(teacher.status());
  });
  absl::Cleanup join = [&] {
    handover.Cancel();
    full.join();
  };
  KVT_ASSIGN_OR_RETURN(*session, open(SpecOf(m.config()), out));
  TierSession* tier = session->get();
  auto line = [&](const std::string& s) {
    if (progress) progress(absl::StrCat(out->id, " (", c.id, ") ", s));
  };
  AgreementSum agreement;
  out->replay.clear();
  auto score = [&](int r, std::vector<float> logits) -> absl::Status {
    KVT_ASSIGN_OR_RETURN(std::vector<float> full_logits, handover.Take(r));
    const ReplayRound& x = c.rounds[r];
    const size_t want = x.assistant.size() * static_cast<size_t>(vocab);
    if (full_logits.size() != want || logits.size() != want) {
      return absl::InternalError(absl::StrCat("round ", r, ": ", full_logits.size(), " and ",
                                              logits.size(), " logits for ", want));
    }
    agreement.Add(full_logits.data(), logits.data(), x.assistant.size(), vocab);
    out->replay.push_back(ScoreReplayRound(x, full_logits.data(), logits.data(), vocab));
    return absl::OkStatus();
  };
  KVT_ASSIGN_OR_RETURN(Transcript t, RunScript(m, script, tier, line, score, options));
  std::move(join).Invoke();
  KVT_RETURN_IF_ERROR(teacher.status());
  out->agreement = agreement.Result();
  if (const model::Tokenizer* tok = m.tokenizer(); tok != nullptr) {
    auto contains = [](std::string text, std::string value) {
      return absl::StrContains(absl::AsciiStrToLower(text), absl::AsciiStrToLower(value));
    };
    for (size_t r = 0; r < c.rounds.size() && r < out->replay.size(); ++r) {
      if (c.rounds[r].expect.empty()) continue;
      DemoSession::Answer a;
      a.round = static_cast<int>(r);
      // The question: the round's text up to its answer's opening.
      a.question = std::string(absl::StripAsciiWhitespace(c.rounds[r].user_text));
      a.expect = c.rounds[r].expect;
      a.full_cache = tok->Decode(out->replay[r].local_tokens);
      a.kvtier = tok->Decode(out->replay[r].tier_tokens);
      a.full_cache_right = contains(a.full_cache, a.expect);
      a.kvtier_right = contains(a.kvtier, a.expect);
      out->answers.push_back(std::move(a));
    }
  }
  for (const ReplayRound& r : c.rounds)
    out->decode_tokens += static_cast<int64_t>(r.assistant.size());
  out->tier_decode_ms = t.decode_ms_per_token * out->decode_tokens;
  out->local_decode_ms = teacher->decode_ms_per_token * out->decode_tokens;
  out->rounds = tier->rounds();
  out->on_device = tier->on_device();
  out->speculation_on_device = tier->speculation_on_device();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::Policy> DemoPolicy(const DemoOptions& o) {
  v1::Policy p;
  KVT_ASSIGN_OR_RETURN(CodecConfig c, ParseCodecSetting(o.codec));
  p.set_codec(ToProto(c.codec));
  *p.mutable_codec_params() = ToParams(c);
  KVT_ASSIGN_OR_RETURN(RecallStrategy rs, ParseRecall(o.recall));
  p.set_recall(RecallName(rs));
  if (absl::StartsWith(o.evict, "profile:")) {
    // The engine reads the profile; its budgets go on the wire (a worker
    // reads no file a client names).
    KVT_ASSIGN_OR_RETURN(evict::Policy e, evict::ParsePolicy(o.evict));
    p.set_eviction(absl::StrCat("profile:", e.profile_name));
    for (int64_t b : e.layer_budgets) p.add_layer_budgets(static_cast<uint32_t>(b));
    p.set_window(static_cast<uint32_t>(e.score.window));
    p.set_pool_kernel(static_cast<uint32_t>(e.score.kernel));
  } else if (!o.evict.empty() && o.evict != "none") {
    KVT_RETURN_IF_ERROR(evict::ParsePolicy(o.evict).status());
    const std::vector<std::string> parts = absl::StrSplit(o.evict, ':');
    uint32_t budget = 0;
    if (parts.size() < 2 || !absl::SimpleAtoi(parts[1], &budget) || budget == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("evict '", o.evict, "': expected none or METHOD:BUDGET[:k=v...]"));
    }
    p.set_eviction(parts[0]);
    p.set_budget_tokens(budget);
    for (size_t i = 2; i < parts.size(); ++i) {
      const std::vector<std::string> kv = absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
      double x = 0;
      if (kv.size() != 2 || !absl::SimpleAtod(kv[1], &x)) {
        return absl::InvalidArgumentError(
            absl::StrCat("evict '", o.evict, "': bad '", parts[i], "'"));
      }
      if (kv[0] == "w") {
        p.set_window(static_cast<uint32_t>(x));
      } else if (kv[0] == "k") {
        p.set_pool_kernel(static_cast<uint32_t>(x));
      } else if (kv[0] == "alpha") {
        p.set_ada_alpha(static_cast<float>(x));
      } else if (kv[0] == "beta") {
        p.set_pyramid_beta(static_cast<uint32_t>(x));
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "evict '", o.evict, "': the worker takes w, k, alpha and beta, not ", kv[0]));
      }
    }
  }
  const int lw = o.watershed >= 0 ? o.watershed : (o.model.empty() ? kSyntheticWatershed : -1);
  if (lw == 0) {
    return absl::InvalidArgumentError("watershed 0 is not supported on the wire (0 means default)");
  }
  if (lw > 0) p.set_watershed_layer(static_cast<uint32_t>(lw));
  if (o.answer_prefill && (o.conversations.empty() || !o.speculation.empty())) {
    return absl::InvalidArgumentError(
        "--answer_prefill needs --conversations and no --speculation (speculation acts at decode "
        "steps)");
  }
  if (!o.speculation.empty()) {
    const std::vector<std::string> parts = absl::StrSplit(o.speculation, ':');
    double alpha = 0;
    uint32_t budget = 0;
    uint64_t pool = 0, low = 0;
    if (parts.size() > 4 || !absl::SimpleAtod(parts[0], &alpha) || !(alpha > 0) ||
        !std::isfinite(alpha) || (parts.size() >= 2 && !absl::SimpleAtoi(parts[1], &budget)) ||
        (parts.size() >= 3 && !absl::SimpleAtoi(parts[2], &pool)) ||
        (parts.size() == 4 && (!absl::SimpleAtoi(parts[3], &low) || low > pool))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "speculation '", o.speculation,
          "': expected ALPHA[:BUDGET[:POOL_BYTES[:LOW_BYTES]]], ALPHA > 0 in softmax-logit units "
          "(4 is the paper's), BUDGET the most tokens per head (0: none), POOL_BYTES the cap on "
          "each session's host pool (0: none), LOW_BYTES where its trims stop (at most "
          "POOL_BYTES; 0: the cap)"));
    }
    p.set_speculation_alpha(static_cast<float>(alpha));
    p.set_speculation_budget(budget);
    p.set_speculation_pool_bytes(pool);
    p.set_speculation_pool_low_bytes(low);
  }
  p.set_keep_recent_round(true);
  p.set_release_after_end_round(true);
  return p;
}

absl::StatusOr<DemoReport> RunDemo(const DemoOptions& o,
                                   const std::function<void(const std::string&)>& progress) {
  if (!o.decode_worker.empty() && !o.controller.empty()) {
    return absl::InvalidArgumentError(
        "a decode worker is for a standalone prefill worker, not for a controller's cluster");
  }
  if (o.inproc) {
    if (!o.worker.empty() || !o.controller.empty() || !o.decode_worker.empty()) {
      return absl::InvalidArgumentError(
          "in-process mode runs the worker engine here: give a store (--store), not a worker, "
          "a decode worker or a controller");
    }
    if (o.store.empty()) {
      return absl::InvalidArgumentError(
          "in-process mode keeps its rounds in a kvtier-store: give its address (--store)");
    }
  } else if (o.worker.empty() == o.controller.empty()) {
    return absl::InvalidArgumentError("give a worker address or a controller address");
  }
  if (o.sessions < 1 || o.sessions > 256 || o.rounds < 1) {
    return absl::InvalidArgumentError("sessions must be in [1, 256] and rounds >= 1");
  }
  KVT_ASSIGN_OR_RETURN(v1::Policy policy, DemoPolicy(o));
  std::string skew_bytes;
  if (!o.speculation.empty()) {
    if (o.model.empty()) {
      return absl::InvalidArgumentError(
          "speculation needs a model (--model): the engine computes each layer's next-layer "
          "query from its weights, and the synthetic chat has none");
    }
    if (o.skew.empty()) {
      return absl::InvalidArgumentError(
          "speculation needs the model's skew file (--skew; make one with kvtier calibrate "
          "infinigen)");
    }
    KVT_ASSIGN_OR_RETURN(skew_bytes, spec::ReadSkewFile(o.skew));
  }
  std::unique_ptr<model::Model> m;
  DemoReport rep;
  rep.rounds = o.rounds;
  std::vector<ReplayConversation> replay;
  if (!o.conversations.empty()) {
    if (o.model.empty()) {
      return absl::InvalidArgumentError(
          "replaying conversations needs the model their token ids belong to (--model)");
    }
    KVT_ASSIGN_OR_RETURN(replay, LoadConversations(o.conversations));
    rep.conversations = o.conversations;
    rep.answer_prefill = o.answer_prefill;
  }
  std::optional<TeacherCache> teachers;
  if (!o.teacher_cache.empty()) {
    if (o.conversations.empty()) {
      return absl::InvalidArgumentError(
          "--teacher_cache keeps the full cache of replayed conversations: it needs "
          "--conversations");
    }
    // The logits depend on the model file and on the code that computes
    // them: an entry is found only by the same file and the same binary.
    KVT_ASSIGN_OR_RETURN(std::string model_id, FileIdentity(o.model));
    KVT_ASSIGN_OR_RETURN(std::string binary_id, FileIdentity("/proc/self/exe"));
    KVT_ASSIGN_OR_RETURN(
        teachers, TeacherCache::Open(o.teacher_cache, absl::StrCat(model_id, "\n", binary_id)));
  }
  if (!o.model.empty()) {
    KVT_ASSIGN_OR_RETURN(m, model::Model::Load(o.model));
    rep.workload = o.model;
    rep.layers = m->config().n_layers;
    rep.kv_heads = m->config().n_kv_heads;
    rep.tokens_per_round = (o.question_tokens > 0 ? o.question_tokens : kModelQuestionTokens) +
                           (o.answer_tokens > 0 ? o.answer_tokens : kModelAnswerTokens);
    if (!replay.empty()) {
      // Nothing runs unless every conversation fits the model.
      KVT_RETURN_IF_ERROR(CheckConversations(replay, m->config()));
      int64_t rounds = 0, tokens = 0;
      for (const ReplayConversation& c : replay) {
        rounds += static_cast<int64_t>(c.rounds.size());
        tokens += c.tokens();
      }
      rep.rounds = static_cast<int>(rounds);
      rep.tokens_per_round = static_cast<int>(tokens / std::max<int64_t>(1, rounds));
    }
  } else {
    traces::SyntheticChatOptions co;
    rep.workload = "synthetic-chat";
    rep.layers = co.layers;
    rep.tokens_per_round = (o.question_tokens > 0 ? o.question_tokens : co.question_tokens) +
                           (o.answer_tokens > 0 ? o.answer_tokens : co.answer_tokens);
  }
  rep.watershed =
      policy.watershed_layer() > 0 ? static_cast<int>(policy.watershed_layer()) : rep.layers / 3;
  if (m != nullptr) {
    worker::ModelShape shape;
    shape.layers = rep.layers;
    shape.window = m->config().window;
    rep.segments_per_round = static_cast<int>(worker::RoundLayout(shape, rep.watershed).size());
  }
  rep.policy = absl::StrCat("codec=", o.codec, " recall=", policy.recall(), " evict=", o.evict,
                            " watershed=", rep.watershed);
  if (!o.speculation.empty()) {
    absl::StrAppend(&rep.policy, " speculation=", o.speculation);
    rep.speculation = o.speculation;
  }
  rep.inproc = o.inproc;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<DecodeMux> mux;
  std::unique_ptr<SessionRouter> router;
  Disaggregation pd;
  OpenTier open;
  std::unique_ptr<StoreSegments> inproc_store;
  std::unique_ptr<worker::Engine> inproc;
  if (o.inproc) {
    // The worker engine in this process, its rounds in the store.
    KVT_ASSIGN_OR_RETURN(auto client, StoreClient::Connect(StoreOptionsOf(o)));
    inproc_store = std::make_unique<StoreSegments>(std::move(client));
    inproc = std::make_unique<worker::Engine>(inproc_store.get());
    if (!skew_bytes.empty()) {
      KVT_ASSIGN_OR_RETURN(std::string id, inproc->skews().Put(skew_bytes));
      policy.set_speculation_skew(id);
    }
    open = [&](const v1::ModelSpec& spec,
               DemoSession* s) -> absl::StatusOr<std::unique_ptr<TierSession>> {
      return InProcessBackend(inproc.get(), spec, s->id, policy);
    };
  } else if (!o.controller.empty()) {
    // A cluster: each session routed through the controller, on its own
    // streams (the shared decode stream is per worker, and sessions move).
    ControllerClientOptions co;
    co.target = o.controller;
    co.token = o.token;
    co.tls_root_certs = o.controller_tls_root_certs;
    if (!co.tls_root_certs.empty()) {
      co.tls_cert_chain = o.tls_cert_chain;
      co.tls_private_key = o.tls_private_key;
    }
    KVT_ASSIGN_OR_RETURN(router,
                         SessionRouter::Connect(co, {.tls_root_certs = o.worker_tls_root_certs,
                                                     .tls_server_name = o.worker_tls_server_name,
                                                     .tls_cert_chain = o.tls_cert_chain,
                                                     .tls_private_key = o.tls_private_key}));
    open = [&](const v1::ModelSpec& spec,
               DemoSession* s) -> absl::StatusOr<std::unique_ptr<TierSession>> {
      KVT_ASSIGN_OR_RETURN(std::unique_ptr<ClusterSession> c,
                           ClusterBackend(spec, router.get(), s->id, policy, o.token, {},
                                          absl::Seconds(15), skew_bytes));
      return std::unique_ptr<TierSession>(std::move(c));
    };
  } else {
    grpc::ChannelArguments args;
    const std::shared_ptr<grpc::ChannelCredentials> creds =
        ClientChannelCredentials(ClientTls{o.worker_tls_root_certs, o.worker_tls_server_name,
                                           o.tls_cert_chain, o.tls_private_key},
                                 &args);
    channel = grpc::CreateCustomChannel(o.worker, creds, args);
    if (!o.decode_worker.empty()) {
      pd.decode_channel = grpc::CreateCustomChannel(o.decode_worker, creds, args);
      pd.prefill_target = o.worker;
      pd.decode_target = o.decode_worker;
    }
    // Every session's decode layers share one long-lived stream, batched (on
    // the decode worker when there is one).
    mux = std::make_unique<DecodeMux>(o.decode_worker.empty() ? channel : pd.decode_channel,
                                      o.token, absl::Seconds(300), o.decode_stream_rotate);
    if (!skew_bytes.empty()) {
      // Each worker that runs a step needs the skew (the decode worker too).
      for (const auto& ch : {channel, pd.decode_channel}) {
        if (ch == nullptr) continue;
        KVT_ASSIGN_OR_RETURN(v1::PutSkewResponse up, UploadSkew(ch, skew_bytes, o.token));
        if (static_cast<int>(up.layers()) != rep.layers) {
          return absl::InvalidArgumentError(absl::StrCat(
              "skew ", o.skew, " is for ", up.layers(), " layers; ", o.model, " has ", rep.layers));
        }
        policy.set_speculation_skew(up.skew_id());
      }
      progress(absl::StrCat("skew ", o.skew, " uploaded as ", policy.speculation_skew()));
    }
    DecodeMux* shared = o.shared_decode_stream ? mux.get() : nullptr;
    open = [&, shared](const v1::ModelSpec& spec, DemoSession* s) {
      return TierBackend(spec, channel, s->id, policy, o.token, {}, shared,
                         o.decode_worker.empty() ? nullptr : &pd);
    };
  }
  // Replay: one session per conversation, `o.sessions` at a time.
  const int count = replay.empty() ? o.sessions : static_cast<int>(replay.size());
  const int parallel = std::min(count, o.sessions);
  rep.sessions.resize(count);
  std::vector<std::unique_ptr<TierSession>> tiers(count);
  std::vector<absl::Status> status(count);
  std::string prefix = o.session_prefix;
  if (prefix.empty()) {
    const uint64_t run = static_cast<uint64_t>(Clock::now().time_since_epoch().count()) ^
                         (static_cast<uint64_t>(::getpid()) << 32);
    prefix = absl::StrFormat("chat-%06x-", run & 0xffffff);
  }
  std::mutex progress_mu;
  auto line = [&](const std::string& s) {
    if (!progress) return;
    std::lock_guard<std::mutex> lock(progress_mu);
    progress(s);
  };
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  std::atomic<int> next{0};
  std::atomic<bool> failed{false};
  for (int i = 0; i < count; ++i) rep.sessions[i].id = absl::StrCat(prefix, i);
  for (int p = 0; p < parallel; ++p) {
    threads.emplace_back([&] {
      for (int i = next++; i < count && !failed; i = next++) {
        status[i] =
            !replay.empty()
                ? RunReplayed(*m, replay[i], open, {.answer_prefill = o.answer_prefill},
                              teachers ? &*teachers : nullptr, &rep.sessions[i], &tiers[i], line)
            : m != nullptr ? RunModel(o, *m, open, i, &rep.sessions[i], &tiers[i], line)
                           : RunSynthetic(o, open, i, &rep.sessions[i], &tiers[i], line);
        if (auto* c = dynamic_cast<ClusterSession*>(tiers[i].get()); c != nullptr) {
          c->RefreshRoute().IgnoreError();  // The report says where it is, not where it was.
          rep.sessions[i].worker = c->worker_node_id();
          rep.sessions[i].stores = c->store_node_ids();
          rep.sessions[i].failovers = c->failovers();
        }
        if (!status[i].ok()) failed = true;
      }
    });
  }
  for (auto& t : threads) t.join();
  rep.seconds = MsSince(t0) / 1000.0;
  if (mux != nullptr) {
    rep.decode_requests = mux->requests();
    rep.decode_items = mux->items();
  }
  // Sessions close (and leave the store when asked) whatever happens next.
  auto close_all = [&]() {
    absl::Status first;
    for (auto& t : tiers) {
      if (t != nullptr) first.Update(t->Close(o.delete_at_end));
      t.reset();
    }
    return first;
  };
  for (int i = 0; i < count; ++i) {
    if (!status[i].ok()) {
      close_all().IgnoreError();
      const DemoSession& d = rep.sessions[i];
      const std::string what =
          d.where.empty() ? d.id : absl::StrCat(d.id, " (conversation at ", d.where, ")");
      return absl::Status(status[i].code(),
                          absl::StrCat("session ", what, ": ", status[i].message()));
    }
  }
  if (!o.store.empty()) {
    KVT_ASSIGN_OR_RETURN(auto client, StoreClient::Connect(StoreOptionsOf(o)));
    absl::StatusOr<v1::StatsResponse> stats = client->Stats();
    if (!stats.ok()) {
      close_all().IgnoreError();
      return absl::Status(stats.status().code(),
                          absl::StrCat("kvtier-store Stats: ", stats.status().message()));
    }
    const v1::StatsResponse& st = *stats;
    rep.store_memory = st.memory();
    rep.store_bytes_ram = 0;
    rep.store_bytes_disk = 0;
    for (const v1::TierStats& t : st.tiers()) {
      if (t.tier() == v1::TIER_RAM) *rep.store_bytes_ram += t.bytes();
      if (t.tier() == v1::TIER_DISK) *rep.store_bytes_disk += t.bytes();
    }
  }
  KVT_RETURN_IF_ERROR(close_all());
  return rep;
}

}  // namespace kvtier::refengine
