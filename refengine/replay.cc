#include "refengine/replay.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "traces/synthetic_chat.h"

namespace kvtier::refengine {
namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;

const char* KindName(const Value& v) {
  switch (v.kind_case()) {
    case Value::kNullValue:
      return "null";
    case Value::kNumberValue:
      return "a number";
    case Value::kStringValue:
      return "a string";
    case Value::kBoolValue:
      return "a boolean";
    case Value::kStructValue:
      return "an object";
    case Value::kListValue:
      return "an array";
    default:
      return "nothing";
  }
}

// The parse position of one line, for messages: "FILE:LINE: FIELD: what".
struct At {
  const std::string& where;
  absl::Status Error(const std::string& field, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", field, ": ", what));
  }
};

// A non-negative integer that fits an int (JSON numbers arrive as doubles;
// 2^31 is far below 2^53, so every such integer is exact).
absl::StatusOr<int> Integer(const At& at, const std::string& field, const Value& v,
                            const char* expected) {
  if (v.kind_case() != Value::kNumberValue) {
    return at.Error(field, absl::StrCat("expected ", expected, ", got ", KindName(v)));
  }
  const double x = v.number_value();
  if (!(x >= 0) || x > 2147483647.0 || std::floor(x) != x) {
    return at.Error(field, absl::StrCat("expected ", expected, ", got ", x));
  }
  return static_cast<int>(x);
}

absl::StatusOr<const ListValue*> List(const At& at, const std::string& field, const Value& v) {
  if (v.kind_case() != Value::kListValue) {
    return at.Error(field, absl::StrCat("expected an array, got ", KindName(v)));
  }
  return &v.list_value();
}

absl::StatusOr<std::vector<int>> Tokens(const At& at, const std::string& field, const Value& v) {
  KVT_ASSIGN_OR_RETURN(const ListValue* l, List(at, field, v));
  if (l->values_size() == 0) return at.Error(field, "needs at least one token id");
  std::vector<int> out;
  out.reserve(l->values_size());
  for (int i = 0; i < l->values_size(); ++i) {
    KVT_ASSIGN_OR_RETURN(int id, Integer(at, absl::StrCat(field, "[", i, "]"), l->values(i),
                                         "a token id (an integer >= 0)"));
    out.push_back(id);
  }
  return out;
}

absl::StatusOr<ReplayRound> Round(const At& at, const std::string& field, const Value& v) {
  if (v.kind_case() != Value::kStructValue) {
    return at.Error(field, absl::StrCat("expected an object with \"user\" and \"assistant\", got ",
                                        KindName(v)));
  }
  const Struct& s = v.struct_value();
  for (const auto& [key, unused] : s.fields()) {
    if (key != "user" && key != "assistant" && key != "score" && key != "user_text" &&
        key != "assistant_text" && key != "expect") {
      return at.Error(field, absl::StrCat("unknown key \"", key,
                                          "\" (a round holds \"user\", \"assistant\" and "
                                          "optionally \"score\", \"user_text\", "
                                          "\"assistant_text\", \"expect\")"));
    }
  }
  ReplayRound r;
  for (auto [key, out] : {std::pair<const char*, std::string*>{"user_text", &r.user_text},
                          {"assistant_text", &r.assistant_text},
                          {"expect", &r.expect}}) {
    auto it = s.fields().find(key);
    if (it == s.fields().end()) continue;
    if (it->second.kind_case() != Value::kStringValue) {
      return at.Error(absl::StrCat(field, ".", key),
                      absl::StrCat("expected a string, got ", KindName(it->second)));
    }
    *out = it->second.string_value();
  }
  for (const char* part : {"user", "assistant"}) {
    auto it = s.fields().find(part);
    if (it == s.fields().end()) return at.Error(field, absl::StrCat("missing \"", part, "\""));
    KVT_ASSIGN_OR_RETURN(std::vector<int> t,
                         Tokens(at, absl::StrCat(field, ".", part), it->second));
    (std::string(part) == "user" ? r.user : r.assistant) = std::move(t);
  }
  auto it = s.fields().find("score");
  if (it != s.fields().end()) {
    const std::string sf = absl::StrCat(field, ".score");
    KVT_ASSIGN_OR_RETURN(const ListValue* spans, List(at, sf, it->second));
    for (int i = 0; i < spans->values_size(); ++i) {
      const std::string f = absl::StrCat(sf, "[", i, "]");
      KVT_ASSIGN_OR_RETURN(const ListValue* span, List(at, f, spans->values(i)));
      if (span->values_size() != 2) {
        return at.Error(
            f, absl::StrCat("expected [begin, end], got ", span->values_size(), " numbers"));
      }
      KVT_ASSIGN_OR_RETURN(int b, Integer(at, f, span->values(0), "an assistant token index"));
      KVT_ASSIGN_OR_RETURN(int e, Integer(at, f, span->values(1), "an assistant token index"));
      if (b >= e || e > static_cast<int>(r.assistant.size())) {
        return at.Error(f,
                        absl::StrCat("[", b, ", ", e, ") is not a non-empty span of the round's ",
                                     r.assistant.size(), " assistant tokens"));
      }
      r.score.emplace_back(b, e);
    }
  }
  return r;
}

absl::StatusOr<ReplayConversation> Line(const std::string& where, int line_no,
                                        absl::string_view line) {
  const At at{where};
  Struct s;
  google::protobuf::util::JsonParseOptions opts;
  auto st = google::protobuf::util::JsonStringToMessage(std::string(line), &s, opts);
  if (!st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": not a JSON object (", st.ToString(),
        "); each line holds one conversation, {\"rounds\": [{\"user\": [...], \"assistant\": "
        "[...]}, ...]}"));
  }
  ReplayConversation c;
  c.where = where;
  c.id = absl::StrCat("line-", line_no);
  for (const auto& [key, unused] : s.fields()) {
    if (key != "id" && key != "rounds") {
      return at.Error(absl::StrCat("\"", key, "\""),
                      "unknown key (a conversation holds \"rounds\" and optionally \"id\")");
    }
  }
  if (auto it = s.fields().find("id"); it != s.fields().end()) {
    if (it->second.kind_case() != Value::kStringValue || it->second.string_value().empty()) {
      return at.Error("id",
                      absl::StrCat("expected a non-empty string, got ", KindName(it->second)));
    }
    c.id = it->second.string_value();
  }
  auto it = s.fields().find("rounds");
  if (it == s.fields().end()) return at.Error("rounds", "missing");
  KVT_ASSIGN_OR_RETURN(const ListValue* rounds, List(at, "rounds", it->second));
  if (rounds->values_size() == 0) return at.Error("rounds", "needs at least one round");
  for (int i = 0; i < rounds->values_size(); ++i) {
    KVT_ASSIGN_OR_RETURN(ReplayRound r,
                         Round(at, absl::StrCat("rounds[", i, "]"), rounds->values(i)));
    c.rounds.push_back(std::move(r));
  }
  return c;
}

}  // namespace

int64_t ReplayConversation::tokens() const {
  int64_t n = 0;
  for (const ReplayRound& r : rounds) n += static_cast<int64_t>(r.user.size() + r.assistant.size());
  return n;
}

std::vector<ScriptRound> ReplayConversation::Script() const {
  std::vector<ScriptRound> s;
  for (const ReplayRound& r : rounds) s.push_back({r.user, r.assistant});
  return s;
}

absl::StatusOr<std::vector<ReplayConversation>> ParseConversations(absl::string_view text,
                                                                   const std::string& name) {
  std::vector<ReplayConversation> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == absl::string_view::npos) continue;
    KVT_ASSIGN_OR_RETURN(ReplayConversation c,
                         Line(absl::StrCat(name, ":", line_no), line_no, line));
    out.push_back(std::move(c));
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": no conversation (one JSON object a line, docs/replay.md)"));
  }
  return out;
}

absl::StatusOr<std::vector<ReplayConversation>> LoadConversations(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read conversations file ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ParseConversations(ss.str(), path);
}

absl::Status CheckConversations(const std::vector<ReplayConversation>& cs,
                                const model::ModelConfig& config) {
  for (const ReplayConversation& c : cs) {
    for (size_t r = 0; r < c.rounds.size(); ++r) {
      for (const char* part : {"user", "assistant"}) {
        const std::vector<int>& t =
            std::string(part) == "user" ? c.rounds[r].user : c.rounds[r].assistant;
        for (size_t i = 0; i < t.size(); ++i) {
          if (t[i] >= config.vocab_size) {
            return absl::InvalidArgumentError(
                absl::StrCat(c.where, ": rounds[", r, "].", part, "[", i, "]: token ", t[i],
                             " is outside the model's vocabulary [0, ", config.vocab_size, ")"));
          }
        }
      }
    }
    if (c.tokens() > config.seq_len) {
      return absl::InvalidArgumentError(
          absl::StrCat(c.where, ": conversation \"", c.id, "\" holds ", c.tokens(),
                       " tokens, more than the model's context of ", config.seq_len));
    }
  }
  return absl::OkStatus();
}

std::string JsonQuote(absl::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    const unsigned char u = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (u < 0x20) {
      absl::StrAppend(&out, absl::StrFormat("\\u%04x", u));
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::string ToJsonl(const std::vector<ReplayConversation>& cs) {
  std::string s;
  for (const ReplayConversation& c : cs) {
    absl::StrAppend(&s, "{\"id\": ", JsonQuote(c.id), ", \"rounds\": [");
    for (size_t r = 0; r < c.rounds.size(); ++r) {
      const ReplayRound& x = c.rounds[r];
      absl::StrAppend(&s, r ? ", " : "", "{\"user\": [", absl::StrJoin(x.user, ", "),
                      "], \"assistant\": [", absl::StrJoin(x.assistant, ", "), "]");
      if (!x.score.empty()) {
        absl::StrAppend(&s, ", \"score\": [");
        for (size_t i = 0; i < x.score.size(); ++i) {
          absl::StrAppend(&s, i ? ", " : "", "[", x.score[i].first, ", ", x.score[i].second, "]");
        }
        absl::StrAppend(&s, "]");
      }
      if (!x.user_text.empty()) absl::StrAppend(&s, ", \"user_text\": ", JsonQuote(x.user_text));
      if (!x.assistant_text.empty()) {
        absl::StrAppend(&s, ", \"assistant_text\": ", JsonQuote(x.assistant_text));
      }
      if (!x.expect.empty()) absl::StrAppend(&s, ", \"expect\": ", JsonQuote(x.expect));
      absl::StrAppend(&s, "}");
    }
    absl::StrAppend(&s, "]}\n");
  }
  return s;
}

ReplayRoundScore ScoreReplayRound(const ReplayRound& x, const float* local, const float* tier,
                                  int vocab) {
  ReplayRoundScore s;
  s.user_tokens = static_cast<int>(x.user.size());
  s.assistant_tokens = static_cast<int>(x.assistant.size());
  std::vector<bool> scored(x.assistant.size(), false);
  for (const auto& [b, e] : x.score) {
    for (int i = b; i < e; ++i) scored[i] = true;
  }
  for (size_t i = 0; i < x.assistant.size(); ++i) {
    const float* p = local + i * vocab;
    const float* q = tier + i * vocab;
    const int lp = model::Argmax(p, vocab), tp = model::Argmax(q, vocab);
    s.top1_agree += lp == tp;
    s.kl_sum += model::KlDivergence(model::Softmax(p, vocab), model::Softmax(q, vocab));
    if (scored[i]) {
      ++s.scored;
      s.local_correct += lp == x.assistant[i];
      s.tier_correct += tp == x.assistant[i];
      s.local_tokens.push_back(lp);
      s.tier_tokens.push_back(tp);
    }
  }
  return s;
}

std::vector<ReplayRoundScore> ScoreReplay(const ReplayConversation& c, const Transcript& local,
                                          const Transcript& tier, int vocab) {
  std::vector<ReplayRoundScore> out;
  for (size_t r = 0; r < c.rounds.size(); ++r) {
    const ReplayRound& x = c.rounds[r];
    const bool have = r < local.logits.size() && r < tier.logits.size() &&
                      local.logits[r].size() == x.assistant.size() * vocab &&
                      tier.logits[r].size() == x.assistant.size() * vocab;
    if (have) {
      out.push_back(ScoreReplayRound(x, local.logits[r].data(), tier.logits[r].data(), vocab));
    } else {
      ReplayRoundScore s;
      s.user_tokens = static_cast<int>(x.user.size());
      s.assistant_tokens = static_cast<int>(x.assistant.size());
      out.push_back(s);
    }
  }
  return out;
}

absl::StatusOr<std::vector<ReplayConversation>> SampleConversations(const model::Model& m,
                                                                    int count, uint64_t seed) {
  if (count < 1) return absl::InvalidArgumentError("count must be >= 1");
  const int ctx = m.config().seq_len;
  std::vector<ReplayConversation> out;
  for (int i = 0; i < count; ++i) {
    traces::SyntheticChatOptions co;
    co.rounds = 64;  // More than fit; the context ends the conversation.
    co.seed = seed * 1000 + static_cast<uint64_t>(i);
    KVT_RETURN_IF_ERROR(traces::ValidateSyntheticChat(co));
    const traces::SyntheticChat chat(co);
    // The model's own text, sliced into the rounds' fresh tokens (after BOS).
    KVT_ASSIGN_OR_RETURN(std::vector<int> text, model::SampleTokens(m, ctx, co.seed));
    size_t cursor = 1;
    std::mt19937_64 rng(co.seed ^ 0x9e3779b97f4a7c15ull);
    auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    auto fresh = [&](int n, std::vector<int>* to) {
      for (int j = 0; j < n; ++j) {
        if (cursor >= text.size()) cursor = 1;
        to->push_back(text[cursor++]);
      }
    };
    ReplayConversation c;
    c.id = absl::StrCat("sample-", i);
    // The full cache follows the conversation as it is written, so that a
    // scored span is what the full-context model answers there.
    model::FullCacheAttention cache(m.config());
    model::Forward f(m);
    std::vector<float> logits(m.config().vocab_size);
    int pos = 0;
    auto feed = [&](const std::vector<int>& tokens, size_t from) -> absl::Status {
      for (size_t j = from; j < tokens.size(); ++j) {
        KVT_RETURN_IF_ERROR(f.Step(tokens[j], pos++, &cache, logits.data()));
      }
      return absl::OkStatus();
    };
    for (int r = 0; r < co.rounds; ++r) {
      ReplayRound x;
      // Mostly short turns, now and then a long one.
      fresh(uniform(0, 5) == 0 ? uniform(24, 60) : uniform(3, 14), &x.user);
      const std::vector<int>& refs = chat.References(r);
      int answer = 0;  // Greedy tokens that open the answer (the scored span).
      if (!refs.empty()) {
        const ReplayRound& from = c.rounds[refs[uniform(0, static_cast<int>(refs.size()) - 1)]];
        const int n = static_cast<int>(from.assistant.size());
        if (n >= 3) {
          const int begin = uniform(0, n - 3);
          x.user.insert(x.user.end(), from.assistant.begin() + begin,
                        from.assistant.begin() + begin + 3);
          answer = uniform(4, 8);
        }
      }
      const size_t budget = static_cast<size_t>(ctx - pos);
      if (x.user.size() + answer + 4 > budget) break;
      KVT_RETURN_IF_ERROR(feed(x.user, 0));
      for (int a = 0; a < answer; ++a) {
        x.assistant.push_back(model::Argmax(logits.data(), m.config().vocab_size));
        KVT_RETURN_IF_ERROR(feed(x.assistant, x.assistant.size() - 1));
      }
      if (answer > 0) x.score.emplace_back(0, answer);
      const size_t before = x.assistant.size();
      fresh(std::min<int>(uniform(4, 20), static_cast<int>(budget - x.user.size() - answer)),
            &x.assistant);
      KVT_RETURN_IF_ERROR(feed(x.assistant, before));
      c.rounds.push_back(std::move(x));
    }
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace kvtier::refengine
