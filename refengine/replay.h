// Conversation replay: a user's own chats, given as token ids, through the
// tier and through the in-process full cache side by side (kvtier-engine
// --conversations, `CONVERSATIONS=file make demo`, kvtier eval watershed
// --conversations). docs/replay.md has the format.
//
// One conversation a line (JSON Lines):
//   {"id": "chat-7", "rounds": [
//     {"user": [1, 403, 22], "assistant": [91, 7, 12, 2], "score": [[0, 2]]}, ...]}
// - "rounds" (required): at least one round; each round's "user" and
//   "assistant" (required) hold at least one token id each.
// - "score" (optional): half-open spans [begin, end) of the round's
//   assistant tokens whose prediction is scored against the given tokens
//   (e.g. the answer to a question about an earlier round).
// - "user_text", "assistant_text" (optional): the rounds' text, for
//   reports (the token ids are what runs).
// - "expect" (optional): the value a round's answer must contain (case-
//   insensitive) to count as right: the fact, stated rounds earlier, that
//   the round's question asks for.
// - "id" (optional): a name for reports; default "line-N".
// Any other key is an error (a misspelt "asistant" must not pass as absent).
#ifndef KVTIER_REFENGINE_REPLAY_H_
#define KVTIER_REFENGINE_REPLAY_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/forward.h"
#include "refengine/conversation.h"

namespace kvtier::refengine {

struct ReplayRound {
  std::vector<int> user, assistant;
  std::vector<std::pair<int, int>> score;  // [begin, end) over `assistant`.
  std::string user_text, assistant_text, expect;
};

struct ReplayConversation {
  std::string id;
  std::string where;  // "FILE:LINE", for messages.
  std::vector<ReplayRound> rounds;
  int64_t tokens() const;
  std::vector<ScriptRound> Script() const;
};

// Parses JSON Lines text (`name` is the file name in messages). Blank lines
// are skipped. INVALID_ARGUMENT naming the line and the field on the first
// malformed line; nothing is returned then. At least one conversation.
absl::StatusOr<std::vector<ReplayConversation>> ParseConversations(absl::string_view text,
                                                                   const std::string& name);
// Reads and parses a file (NOT_FOUND when it cannot be read).
absl::StatusOr<std::vector<ReplayConversation>> LoadConversations(const std::string& path);

// Every token inside the model's vocabulary and every conversation within
// its context; INVALID_ARGUMENT naming the line, round and token otherwise.
absl::Status CheckConversations(const std::vector<ReplayConversation>& c,
                                const model::ModelConfig& config);

// `s` as a JSON string literal, quotes included.
std::string JsonQuote(absl::string_view s);

// One line per conversation, the format above (a round trip of Parse).
std::string ToJsonl(const std::vector<ReplayConversation>& c);

// How the tier did on one replayed round against the full cache, both
// teacher-forced on the given assistant tokens.
struct ReplayRoundScore {
  int user_tokens = 0, assistant_tokens = 0;
  int top1_agree = 0;  // Positions where the tier's argmax is the full cache's.
  double kl_sum = 0;   // Sum over positions of KL(full || tier), nats.
  int scored = 0;      // Positions in the round's score spans.
  int tier_correct = 0, local_correct = 0;  // Argmax equal to the given token there.
  // The greedy tokens there, in order (each predicted after the file's
  // tokens before it).
  std::vector<int> tier_tokens, local_tokens;
};

// Scores a replayed conversation: `local` and `tier` are RunScript's
// transcripts of c.Script() on the full cache and on the tier.
std::vector<ReplayRoundScore> ScoreReplay(const ReplayConversation& c, const Transcript& local,
                                          const Transcript& tier, int vocab);
// One round of it: `local` and `tier` hold x.assistant.size() rows of
// `vocab` logits each.
ReplayRoundScore ScoreReplayRound(const ReplayRound& x, const float* local, const float* tier,
                                  int vocab);

// The sample file's generator (traces/stories260k_chats.jsonl): `count`
// conversations whose rounds follow the synthetic chat's structure
// (traces/synthetic_chat.h: each question refers to earlier rounds) with
// the model's own text. A round that refers to an earlier one quotes three
// tokens of that round's answer at the end of its question, and its answer
// opens with 4 to 8 tokens that the model, holding the whole conversation
// in its full cache, answers greedily there: that span is scored, so the
// full cache scores 1.0 on it by construction and the tier's score is the
// share of those context-dependent answers it reproduces (stories260K is
// too small to copy the quoted round back). Round lengths vary (user 3 to
// 63 tokens, assistant 4 to 28); the conversation ends before the model's
// context is full.
absl::StatusOr<std::vector<ReplayConversation>> SampleConversations(const model::Model& m,
                                                                    int count, uint64_t seed);

}  // namespace kvtier::refengine

#endif  // KVTIER_REFENGINE_REPLAY_H_
