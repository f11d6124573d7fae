#include "refengine/conversation.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace kvtier::refengine {

namespace {

// The rounds of a conversation: each round's user tokens, and either its
// assistant tokens (`forced`) or, where `forced` is null, how many the
// model picks greedily (`greedy`) or takes from `teacher`.
struct Rounds {
  std::vector<std::vector<int>> user;
  const std::vector<std::vector<int>>* forced = nullptr;
  int greedy = 0;
  const Transcript* teacher = nullptr;
  const RoundSink* sink = nullptr;  // Takes each round's logits when set.
  // With `forced`: each round's answer goes as one prefill step after the
  // question's, every position's logits from it (RunScript's options).
  bool answer_prefill = false;
};

absl::StatusOr<Transcript> RunRounds(const model::Model& m, const Rounds& in,
                                     ConversationBackend* b,
                                     const std::function<void(const std::string&)>& progress) {
  const model::ModelConfig& c = m.config();
  const int rounds = static_cast<int>(in.user.size());
  auto answer_len = [&](int r) {
    return in.forced != nullptr ? static_cast<int>((*in.forced)[r].size()) : in.greedy;
  };
  Transcript t;
  model::Forward f(m);
  std::vector<float> logits(c.vocab_size);
  int pos = 0;
  double decode_ms = 0;
  int64_t decode_steps = 0;
  for (int r = 0; r < rounds; ++r) {
    const std::vector<int>& q = in.user[r];
    const int question_tokens = static_cast<int>(q.size());
    const int answer_tokens = answer_len(r);
    const int round_pos = pos;
    std::vector<int> answer;  // Kept across a failover: the user has seen them.
    std::vector<float> round_logits;
    // One attempt at the round: the question as one prefill, then the
    // answer (tokens already produced are sent again, not chosen again).
    auto attempt = [&]() -> absl::Status {
      pos = round_pos;
      round_logits.clear();
      KVT_RETURN_IF_ERROR(b->BeginStep(true, question_tokens, question_tokens));
      KVT_RETURN_IF_ERROR(f.Run(q, pos, b, logits.data()));
      KVT_RETURN_IF_ERROR(b->EndStep());
      pos += question_tokens;
      if (in.forced != nullptr && in.answer_prefill) {
        // The logits before each answer token: the question's last, then
        // the answer's own but the last.
        const std::vector<int>& given = (*in.forced)[r];
        std::vector<float> all(given.size() * static_cast<size_t>(c.vocab_size));
        const auto t0 = std::chrono::steady_clock::now();
        KVT_RETURN_IF_ERROR(b->BeginStep(true, answer_tokens, 0));
        KVT_RETURN_IF_ERROR(f.RunAllLogits(given, pos, b, all.data()));
        KVT_RETURN_IF_ERROR(b->EndStep());
        decode_ms +=
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        decode_steps += answer_tokens;
        round_logits.assign(logits.begin(), logits.end());
        round_logits.insert(round_logits.end(), all.begin(),
                            all.end() - static_cast<ptrdiff_t>(c.vocab_size));
        answer = given;
        pos += answer_tokens;
        return b->EndRound();
      }
      for (int a = 0; a < answer_tokens; ++a) {
        round_logits.insert(round_logits.end(), logits.begin(), logits.end());
        int next;
        if (a < static_cast<int>(answer.size())) {
          next = answer[a];
        } else {
          next = in.forced != nullptr    ? (*in.forced)[r][a]
                 : in.teacher != nullptr ? in.teacher->answers[r][a]
                                         : model::Argmax(logits.data(), c.vocab_size);
          answer.push_back(next);
        }
        const auto t0 = std::chrono::steady_clock::now();
        KVT_RETURN_IF_ERROR(b->BeginStep(false, 1, 0));
        KVT_RETURN_IF_ERROR(f.Run({next}, pos, b, logits.data()));
        KVT_RETURN_IF_ERROR(b->EndStep());
        decode_ms +=
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        ++decode_steps;
        ++pos;
      }
      return b->EndRound();
    };
    for (int tries = 0;; ++tries) {
      absl::Status s = attempt();
      if (s.ok()) break;
      if (tries == 3) return s;
      KVT_ASSIGN_OR_RETURN(uint32_t next, b->Recover(static_cast<uint32_t>(r), s));
      if (progress) {
        progress(absl::StrCat(
            "round ", r, " (", r + 1, " of ", rounds, "): ", s.message(), "; ",
            next == static_cast<uint32_t>(r) ? "sending the round again" : "the round was stored"));
      }
      if (next == static_cast<uint32_t>(r) + 1) {
        pos = round_pos + question_tokens + answer_tokens;
        break;
      }
    }
    t.questions.push_back(q);
    t.answers.push_back(std::move(answer));
    if (in.sink != nullptr && *in.sink) {
      KVT_RETURN_IF_ERROR((*in.sink)(r, std::move(round_logits)));
      t.logits.emplace_back();
    } else {
      t.logits.push_back(std::move(round_logits));
    }
    if (progress) {
      progress(absl::StrCat("round ", r, " (", r + 1, " of ", rounds, "): ", pos, " tokens"));
    }
  }
  t.decode_ms_per_token = decode_steps > 0 ? decode_ms / decode_steps : 0;
  return t;
}

}  // namespace

absl::StatusOr<Transcript> RunConversation(
    const model::Model& m, const ConversationOptions& o, ConversationBackend* b,
    const Transcript* teacher, const std::function<void(const std::string&)>& progress) {
  const model::ModelConfig& c = m.config();
  const int per_round = o.question_tokens + o.answer_tokens;
  if (o.rounds < 1 || o.question_tokens < 1 || o.answer_tokens < 1) {
    return absl::InvalidArgumentError("rounds, question and answer tokens must be >= 1");
  }
  if (o.rounds * per_round > c.seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        o.rounds, " rounds of ", per_round, " tokens exceed the model's context of ", c.seq_len));
  }
  if (teacher != nullptr && static_cast<int>(teacher->answers.size()) != o.rounds) {
    return absl::InvalidArgumentError("the teacher transcript has a different round count");
  }
  // Question text: slices of one sequence the model wrote itself.
  KVT_ASSIGN_OR_RETURN(std::vector<int> source,
                       model::SampleTokens(m, o.rounds * o.question_tokens, o.seed));
  Rounds in;
  for (int r = 0; r < o.rounds; ++r) {
    in.user.emplace_back(source.begin() + r * o.question_tokens,
                         source.begin() + (r + 1) * o.question_tokens);
  }
  in.greedy = o.answer_tokens;
  in.teacher = teacher;
  return RunRounds(m, in, b, progress);
}

absl::StatusOr<Transcript> RunScript(const model::Model& m, const std::vector<ScriptRound>& rounds,
                                     ConversationBackend* b,
                                     const std::function<void(const std::string&)>& progress,
                                     const RoundSink& sink, const ScriptOptions& options) {
  const model::ModelConfig& c = m.config();
  if (rounds.empty()) return absl::InvalidArgumentError("a conversation needs a round");
  int64_t tokens = 0;
  Rounds in;
  std::vector<std::vector<int>> forced;
  for (size_t r = 0; r < rounds.size(); ++r) {
    const ScriptRound& sr = rounds[r];
    if (sr.user.empty() || sr.assistant.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("round ", r, ": user and assistant need at least one token each"));
    }
    for (const std::vector<int>* part : {&sr.user, &sr.assistant}) {
      for (int id : *part) {
        if (id < 0 || id >= c.vocab_size) {
          return absl::InvalidArgumentError(absl::StrCat("round ", r, ": token ", id,
                                                         " is outside the model's vocabulary [0, ",
                                                         c.vocab_size, ")"));
        }
      }
    }
    tokens += static_cast<int64_t>(sr.user.size() + sr.assistant.size());
    in.user.push_back(sr.user);
    forced.push_back(sr.assistant);
  }
  if (tokens > c.seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("the conversation holds ", tokens,
                                                   " tokens, more than the model's context of ",
                                                   c.seq_len));
  }
  in.forced = &forced;
  in.sink = &sink;
  in.answer_prefill = options.answer_prefill;
  return RunRounds(m, in, b, progress);
}

void AgreementSum::Add(const float* teacher, const float* t, size_t positions, int vocab) {
  for (size_t i = 0; i < positions; ++i) {
    const float* p = teacher + i * vocab;
    const float* q = t + i * vocab;
    agree_ += model::Argmax(p, vocab) == model::Argmax(q, vocab);
    kl_ += model::KlDivergence(model::Softmax(p, vocab), model::Softmax(q, vocab));
    for (int v = 0; v < vocab; ++v) {
      max_logit_diff_ = std::max(max_logit_diff_, static_cast<double>(std::fabs(p[v] - q[v])));
    }
    ++n_;
  }
}

Agreement AgreementSum::Result() const {
  Agreement a;
  a.top1 = n_ > 0 ? static_cast<double>(agree_) / n_ : 0;
  a.kl = n_ > 0 ? kl_ / n_ : 0;
  a.max_logit_diff = max_logit_diff_;
  return a;
}

Agreement Compare(const Transcript& teacher, const Transcript& t, int vocab) {
  AgreementSum sum;
  for (size_t r = 0; r < teacher.logits.size() && r < t.logits.size(); ++r) {
    sum.Add(teacher.logits[r].data(), t.logits[r].data(),
            std::min(teacher.logits[r].size(), t.logits[r].size()) / vocab, vocab);
  }
  return sum.Result();
}

}  // namespace kvtier::refengine
