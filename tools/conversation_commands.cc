// `kvtier conversations`: the replay file format (docs/replay.md): check a
// file before a long run, and write the sample file.
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "refengine/replay.h"
#include "tools/cli_args.h"

namespace kvtier::cli {
namespace {

constexpr char kHelp[] =
    "kvtier conversations check FILE [--model=PATH]\n"
    "  Parses a JSON Lines file of conversations in token ids (docs/replay.md) and prints\n"
    "  what it holds; with --model, also checks every token against the model's vocabulary\n"
    "  and every conversation against its context. Exit 2 and the line and field of the\n"
    "  first problem otherwise.\n\n"
    "kvtier conversations sample --model=PATH [--count=N] [--seed=S] [--out=FILE]\n"
    "  Writes conversations whose rounds follow the synthetic chat's structure, with the\n"
    "  model's own text: a round that refers to an earlier one quotes three tokens of its\n"
    "  answer, and the continuation is the scored span (traces/stories260k_chats.jsonl is\n"
    "  `--count=4 --seed=1` on stories260K). Default: 4 conversations to stdout.\n";

int Fail(const std::string& msg, int code) {
  std::fprintf(stderr, "kvtier conversations: %s\n", msg.c_str());
  return code;
}

int Check(const Args& args) {
  if (args.positional().size() != 2) return Fail("check takes one FILE (see --help)", 2);
  const std::string path = args.positional()[1];
  auto cs = refengine::LoadConversations(path);
  if (!cs.ok()) return Fail(std::string(cs.status().message()), 2);
  if (args.Has("model")) {
    auto m = model::Model::Load(args.Get("model"));
    if (!m.ok()) return Fail(std::string(m.status().message()), 1);
    if (auto s = refengine::CheckConversations(*cs, (*m)->config()); !s.ok()) {
      return Fail(std::string(s.message()), 2);
    }
  }
  int64_t rounds = 0, user = 0, assistant = 0, scored = 0, longest = 0;
  for (const refengine::ReplayConversation& c : *cs) {
    rounds += static_cast<int64_t>(c.rounds.size());
    longest = std::max(longest, c.tokens());
    for (const refengine::ReplayRound& r : c.rounds) {
      user += static_cast<int64_t>(r.user.size());
      assistant += static_cast<int64_t>(r.assistant.size());
      for (const auto& [b, e] : r.score) scored += e - b;
    }
  }
  std::printf(
      "%s: %zu conversations, %lld rounds, %lld user + %lld assistant tokens (longest "
      "conversation %lld), %lld scored assistant tokens%s\n",
      path.c_str(), cs->size(), static_cast<long long>(rounds), static_cast<long long>(user),
      static_cast<long long>(assistant), static_cast<long long>(longest),
      static_cast<long long>(scored),
      args.Has("model") ? absl::StrCat("; fits ", args.Get("model")).c_str() : "");
  return 0;
}

int Sample(const Args& args) {
  if (!args.Has("model")) return Fail("sample needs --model=PATH", 2);
  auto m = model::Model::Load(args.Get("model"));
  if (!m.ok()) return Fail(std::string(m.status().message()), 1);
  const int count = static_cast<int>(args.GetU64("count", 4));
  auto cs = refengine::SampleConversations(**m, count, args.GetU64("seed", 1));
  if (!cs.ok()) return Fail(std::string(cs.status().message()), 2);
  const std::string text = refengine::ToJsonl(*cs);
  if (!args.Has("out")) {
    std::fputs(text.c_str(), stdout);
    return 0;
  }
  std::ofstream f(args.Get("out"));
  f << text;
  if (!f) return Fail(absl::StrCat("cannot write ", args.Get("out")), 1);
  std::fprintf(stderr, "wrote %zu conversations to %s\n", cs->size(), args.Get("out").c_str());
  return 0;
}

}  // namespace

int ConversationsCommand(const Args& args) {
  const auto unknown = args.Unknown({"model", "count", "seed", "out", "help"});
  if (!unknown.empty()) {
    std::fprintf(stderr, "kvtier conversations: unknown flag --%s\n\n%s", unknown[0].c_str(),
                 kHelp);
    return 2;
  }
  const std::string sub = args.positional().empty() ? "" : args.positional()[0];
  if (args.Has("help") || sub == "help") {
    std::printf("%s", kHelp);
    return 0;
  }
  if (sub == "check") return Check(args);
  if (sub == "sample") return Sample(args);
  std::fprintf(stderr, "kvtier conversations: %s\n\n%s",
               sub.empty() ? "check or sample?" : ("unknown subcommand '" + sub + "'").c_str(),
               kHelp);
  return 2;
}

}  // namespace kvtier::cli
