// `kvtier eval watershed`: the watershed layer L_w of Round Attention from a
// conversation's round-attention distributions (refengine/watershed.h).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "refengine/watershed.h"
#include "tools/cli_args.h"

namespace kvtier::cli {
namespace {

constexpr char kWatershedHelp[] =
    "kvtier eval watershed [flags]\n"
    "  For each question of a multi-round conversation and each layer, the question's\n"
    "  attention over the past rounds (qAttention, as the worker computes it). Prints per\n"
    "  layer the mean KL(P_later || P_layer) against every later layer and how many past\n"
    "  rounds hold --mass of the attention, then L_w: the first layer from which the mean\n"
    "  KL stays at or below --kl_threshold at every later layer. On a model with\n"
    "  sliding-window layers, a later sliding layer is compared only over the rounds still\n"
    "  inside its window (the ones recall can change there).\n\n"
    "  --model=PATH        a GGUF file or llama2.c checkpoint (e.g. stories260K.bin);\n"
    "                      without it, the embedded synthetic chat (traces/synthetic_chat.h)\n"
    "  --conversations=FILE  with --model: your own conversations instead of a generated one\n"
    "                      (JSON Lines of token ids, docs/replay.md; every conversation's\n"
    "                      questions with 2 or more past rounds are probes)\n"
    "  --rounds=N          rounds (default: 24 synthetic, 24 model)\n"
    "  --question_tokens=N, --answer_tokens=N  per round (default 16/16 synthetic, 10/11 model)\n"
    "  --mass=P            attention mass to cover (default 0.95)\n"
    "  --kl_threshold=X    nats; 'low' for the L_w rule (default 0.01)\n"
    "  --seed=S            conversation seed (default 1)\n"
    "  --csv=FILE          also write one CSV row per layer\n";

}  // namespace

int EvalWatershed(const Args& args) {
  const auto unknown =
      args.Unknown({"model", "conversations", "rounds", "question_tokens", "answer_tokens", "mass",
                    "kl_threshold", "seed", "csv", "help"});
  if (!unknown.empty() || args.Has("help")) {
    if (!unknown.empty())
      std::fprintf(stderr, "kvtier eval: unknown flag --%s\n\n", unknown[0].c_str());
    std::fprintf(unknown.empty() ? stdout : stderr, "%s", kWatershedHelp);
    return unknown.empty() ? 0 : 2;
  }
  double mass = 0.95;
  if (args.Has("mass") && (!absl::SimpleAtod(args.Get("mass"), &mass) || mass <= 0 || mass > 1)) {
    std::fprintf(stderr, "kvtier eval watershed: --mass must be in (0, 1]\n");
    return 2;
  }
  double kl_threshold = 0.01;
  if (args.Has("kl_threshold") &&
      (!absl::SimpleAtod(args.Get("kl_threshold"), &kl_threshold) || !(kl_threshold >= 0))) {
    std::fprintf(stderr, "kvtier eval watershed: --kl_threshold must be >= 0\n");
    return 2;
  }
  const uint64_t seed = args.GetU64("seed", 1);
  refengine::RoundDistributions dist;
  std::string what;
  if (args.Has("conversations") && !args.Has("model")) {
    std::fprintf(stderr,
                 "kvtier eval watershed: --conversations needs --model (the model whose token ids "
                 "they hold)\n");
    return 2;
  }
  if (args.Has("conversations")) {
    auto m = model::Model::Load(args.Get("model"));
    if (!m.ok()) {
      std::fprintf(stderr, "kvtier eval watershed: %s\n",
                   std::string(m.status().message()).c_str());
      return 1;
    }
    auto convs = refengine::LoadConversations(args.Get("conversations"));
    if (!convs.ok()) {
      std::fprintf(stderr, "kvtier eval watershed: %s\n",
                   std::string(convs.status().message()).c_str());
      return 2;
    }
    what = absl::StrCat(args.Get("conversations"), " (", convs->size(), " conversations) on ",
                        args.Get("model"));
    std::fprintf(stderr, "replaying %s...\n", what.c_str());
    auto d = refengine::ReplayDistributions(**m, *convs);
    if (!d.ok()) {
      std::fprintf(stderr, "kvtier eval watershed: %s\n",
                   std::string(d.status().message()).c_str());
      return absl::IsInvalidArgument(d.status()) ? 2 : 1;
    }
    dist = std::move(*d);
  } else if (args.Has("model")) {
    auto m = model::Model::Load(args.Get("model"));
    if (!m.ok()) {
      std::fprintf(stderr, "kvtier eval watershed: %s\n",
                   std::string(m.status().message()).c_str());
      return 1;
    }
    refengine::ConversationOptions o;
    o.rounds = static_cast<int>(args.GetU64("rounds", 24));
    o.question_tokens = static_cast<int>(args.GetU64("question_tokens", 10));
    o.answer_tokens = static_cast<int>(args.GetU64("answer_tokens", 11));
    o.seed = seed;
    what = absl::StrCat(args.Get("model"), ", ", o.rounds, " rounds x (", o.question_tokens,
                        " question + ", o.answer_tokens, " greedy answer tokens)");
    std::fprintf(stderr, "running the conversation on %s...\n", what.c_str());
    auto d = refengine::ModelDistributions(**m, o);
    if (!d.ok()) {
      std::fprintf(stderr, "kvtier eval watershed: %s\n",
                   std::string(d.status().message()).c_str());
      return 1;
    }
    dist = std::move(*d);
  } else {
    traces::SyntheticChatOptions o;
    o.rounds = static_cast<int>(args.GetU64("rounds", o.rounds));
    o.question_tokens = static_cast<int>(args.GetU64("question_tokens", o.question_tokens));
    o.answer_tokens = static_cast<int>(args.GetU64("answer_tokens", o.answer_tokens));
    o.seed = seed;
    if (auto s = traces::ValidateSyntheticChat(o); !s.ok()) {
      std::fprintf(stderr, "kvtier eval watershed: %s\n", std::string(s.message()).c_str());
      return 2;
    }
    what = absl::StrCat("synthetic chat, ", o.layers, " layers, ", o.rounds, " rounds x (",
                        o.question_tokens, " + ", o.answer_tokens, " tokens), topics from layer ",
                        o.topic_layer);
    std::fprintf(stderr, "generating the %s...\n", what.c_str());
    dist = refengine::SyntheticChatDistributions(traces::SyntheticChat(o));
  }
  if (dist.dist.empty()) {
    std::fprintf(stderr, "kvtier eval watershed: no question has 2 past rounds; use more rounds\n");
    return 2;
  }
  const refengine::WatershedReport w = refengine::AnalyzeWatershed(dist, mass, kl_threshold);
  std::printf("%s: %zu questions, %.1f past rounds on average\n\n", what.c_str(), dist.dist.size(),
              w.past_rounds_mean);
  const bool sliding =
      std::any_of(dist.window.begin(), dist.window.end(), [](int x) { return x > 0; });
  std::printf("%5s  %14s  %22s%s\n", "layer", "mean KL (nats)",
              absl::StrCat("rounds for ", mass * 100, "% mass").c_str(),
              sliding ? "  kind        rounds at stake" : "");
  std::printf("%5s  %14s  %10s %11s\n", "", "vs later", "mean", "max");
  std::unique_ptr<std::ofstream> csv;
  if (args.Has("csv")) {
    csv = std::make_unique<std::ofstream>(args.Get("csv"));
    *csv << "layer,mean_kl_vs_later,rounds_for_mass_mean,rounds_for_mass_max,mass,window,"
            "rounds_at_stake_mean\n";
  }
  for (int l = 0; l < dist.layers; ++l) {
    const bool has_kl = l < static_cast<int>(w.mean_kl.size());
    const int win = dist.window.empty() ? 0 : dist.window[l];
    const std::string kind =
        !sliding
            ? ""
            : absl::StrFormat("  %-11s %15.2f", win > 0 ? absl::StrCat("slides ", win) : "global",
                              w.at_stake_mean[l]);
    std::printf("%5d  %14s  %10.2f %11d%s%s\n", l,
                has_kl ? absl::StrCat(absl::SixDigits(w.mean_kl[l])).c_str() : "-",
                w.rounds_for_mass_mean[l], w.rounds_for_mass_max[l], kind.c_str(),
                l == w.watershed ? "   <- L_w" : "");
    if (csv) {
      *csv << l << "," << (has_kl ? absl::StrCat(w.mean_kl[l]) : "") << ","
           << w.rounds_for_mass_mean[l] << "," << w.rounds_for_mass_max[l] << "," << mass << ","
           << win << "," << w.at_stake_mean[l] << "\n";
    }
  }
  if (w.watershed < 0) {
    std::printf(
        "\nNo watershed: no layer's mean KL stays <= %g nats. The round distribution keeps\n"
        "changing up to the last layer, so rounds chosen at any layer are not the ones the layers\n"
        "above it attend to; expect selective recall to cost fidelity on this model.\n",
        kl_threshold);
    return 0;
  }
  std::printf(
      "\nL_w = %d of %d layers (L_w / L = %.2f; published range 0.18-0.46): the first layer whose "
      "mean KL stays <= %g nats\n",
      w.watershed, dist.layers, static_cast<double>(w.watershed) / dist.layers, kl_threshold);
  return 0;
}

}  // namespace kvtier::cli
