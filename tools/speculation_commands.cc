// `kvtier calibrate infinigen` (the skew file) and `kvtier eval speculation`
// (hit rate, fidelity and bytes touched of InfiniGen speculation):
// eval/speculation_eval.h, docs/speculation.md.
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "eval/speculation_eval.h"
#include "refengine/replay.h"
#include "tools/cli_args.h"

namespace kvtier::cli {
namespace {

constexpr char kCalibrateHelp[] =
    "kvtier calibrate infinigen --model=PATH --out=FILE [flags]\n"
    "  Runs calibration text through the model, takes per layer and KV head the SVD of the\n"
    "  post-RoPE queries and keys, and writes the skew (Q's right singular vectors ordered by\n"
    "  sigma_q * sigma_k) and the partial columns (the top --partial_ratio of head_dim by\n"
    "  sum |q A|) to FILE: versioned, CRC-32C checked. Prints per layer the attention error\n"
    "  of skewed against unskewed q/k (the skew is exact up to float rounding) and the share\n"
    "  of the query's energy the partial columns hold, skewed and unskewed.\n\n"
    "  --partial_ratio=R     partial columns as a share of head_dim (default 0.2)\n"
    "  --conversations=FILE  calibrate on these conversations (docs/replay.md), each as one\n"
    "                        sequence; default: --sequences texts the model samples itself\n"
    "  --sequences=N         sampled calibration sequences of the model's context (default 4)\n"
    "  --seed=S              sampling seed (default 1)\n";

constexpr char kEvalHelp[] =
    "kvtier eval speculation --model=PATH [flags]\n"
    "  Replays conversations teacher-forced twice: on the dense full cache, and with every\n"
    "  decode step of layers >= 1 attending only over the tokens InfiniGen speculates from\n"
    "  the previous layer's attention input. Prints per (partial ratio, alpha) the hit rate\n"
    "  per layer (the share of the true top-n attention mass the speculated n tokens cover),\n"
    "  the tokens kept, top-1 agreement and KL against the dense run, the attention-output\n"
    "  error, and the K/V bytes read per decode token against dense, all in the same run.\n\n"
    "  --conversations=FILE  default: traces/stories260k_chats.jsonl (from the checkout root)\n"
    "  --skew=FILE           a calibrated skew (kvtier calibrate infinigen); default:\n"
    "                        calibrate here on sampled text at each --partial_ratio\n"
    "  --partial_ratio=LIST  default 0.1,0.2,0.3\n"
    "  --alpha=LIST          default 2,4,6\n"
    "  --budget=N            cap on tokens per head (default 0: none)\n"
    "  --oracle              speculate with each layer's own query instead of the previous\n"
    "                        layer's approximation (separates the two sources of error)\n"
    "  --csv=FILE            also write one CSV row per (ratio, alpha, layer)\n";

int Fail(const char* cmd, const std::string& msg, int code) {
  std::fprintf(stderr, "kvtier %s: %s\n", cmd, msg.c_str());
  return code;
}

bool ParseList(const std::string& text, std::vector<double>* out) {
  out->clear();
  for (absl::string_view p : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    double x;
    if (!absl::SimpleAtod(p, &x)) return false;
    out->push_back(x);
  }
  return !out->empty();
}

// Calibration text: sampled sequences of the model's context.
absl::StatusOr<std::vector<std::vector<int>>> SampledText(const model::Model& m, int n,
                                                          uint64_t seed) {
  std::vector<std::vector<int>> out;
  for (int i = 0; i < n; ++i) {
    KVT_ASSIGN_OR_RETURN(std::vector<int> t,
                         model::SampleTokens(m, m.config().seq_len, seed * 7919 + i));
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<int> Flatten(const refengine::ReplayConversation& c) {
  std::vector<int> t;
  for (const refengine::ReplayRound& r : c.rounds) {
    t.insert(t.end(), r.user.begin(), r.user.end());
    t.insert(t.end(), r.assistant.begin(), r.assistant.end());
  }
  return t;
}

}  // namespace

int CalibrateCommand(const Args& args) {
  const char* cmd = "calibrate infinigen";
  const auto unknown =
      args.Unknown({"model", "out", "partial_ratio", "conversations", "sequences", "seed", "help"});
  const std::string sub = args.positional().empty() ? "" : args.positional()[0];
  if (args.Has("help") || sub == "help" || sub.empty() || !unknown.empty() || sub != "infinigen") {
    const bool ok = args.Has("help") || sub == "help";
    if (!unknown.empty())
      std::fprintf(stderr, "kvtier calibrate: unknown flag --%s\n\n", unknown[0].c_str());
    std::fprintf(ok ? stdout : stderr, "%s", kCalibrateHelp);
    return ok ? 0 : 2;
  }
  if (!args.Has("model") || !args.Has("out")) return Fail(cmd, "needs --model and --out", 2);
  double ratio = 0.2;
  if (args.Has("partial_ratio") &&
      (!absl::SimpleAtod(args.Get("partial_ratio"), &ratio) || !(ratio > 0 && ratio <= 1))) {
    return Fail(cmd, "--partial_ratio must be in (0, 1]", 2);
  }
  auto m = model::Model::Load(args.Get("model"));
  if (!m.ok()) return Fail(cmd, std::string(m.status().message()), 1);
  std::vector<std::vector<int>> seqs;
  std::string what;
  if (args.Has("conversations")) {
    auto cs = refengine::LoadConversations(args.Get("conversations"));
    if (!cs.ok()) return Fail(cmd, std::string(cs.status().message()), 2);
    if (auto s = refengine::CheckConversations(*cs, (*m)->config()); !s.ok()) {
      return Fail(cmd, std::string(s.message()), 2);
    }
    for (const auto& c : *cs) seqs.push_back(Flatten(c));
    what = args.Get("conversations");
  } else {
    const int n = static_cast<int>(args.GetU64("sequences", 4));
    if (n < 1) return Fail(cmd, "--sequences must be >= 1", 2);
    auto t = SampledText(**m, n, args.GetU64("seed", 1));
    if (!t.ok()) return Fail(cmd, std::string(t.status().message()), 1);
    seqs = std::move(*t);
    what = absl::StrCat(n, " sequences the model sampled");
  }
  std::fprintf(stderr, "calibrating on %s...\n", what.c_str());
  eval::CalibrationReport rep;
  auto skew = eval::CalibrateSkew(**m, seqs, ratio, args.Get("model"), &rep);
  if (!skew.ok()) return Fail(cmd, std::string(skew.status().message()), 1);
  std::printf(
      "%s: %d layers x %d KV heads, head_dim %d, %d partial columns (ratio %g), %lld "
      "calibration tokens\n\n",
      args.Get("model").c_str(), skew->layers, skew->kv_heads, skew->head_dim,
      skew->partial_columns(), ratio, static_cast<long long>(rep.tokens));
  std::printf("%5s  %22s  %26s\n", "layer", "skew invariance error", "query energy in partial");
  std::printf("%5s  %22s  %12s %13s\n", "", "(attention outputs)", "skewed", "unskewed");
  for (int l = 0; l < skew->layers; ++l) {
    std::printf("%5d  %22.2e  %12.3f %13.3f\n", l, rep.invariance_err[l], rep.energy_skewed[l],
                rep.energy_raw[l]);
  }
  if (auto s = spec::SaveSkew(args.Get("out"), *skew); !s.ok()) {
    return Fail(cmd, std::string(s.message()), 1);
  }
  std::printf("\nwrote %s\n", args.Get("out").c_str());
  return 0;
}

int EvalSpeculation(const Args& args) {
  const char* cmd = "eval speculation";
  const auto unknown = args.Unknown({"model", "conversations", "skew", "partial_ratio", "alpha",
                                     "budget", "csv", "oracle", "help"});
  if (!unknown.empty() || args.Has("help")) {
    if (!unknown.empty())
      std::fprintf(stderr, "kvtier eval: unknown flag --%s\n\n", unknown[0].c_str());
    std::fprintf(unknown.empty() ? stdout : stderr, "%s", kEvalHelp);
    return unknown.empty() ? 0 : 2;
  }
  if (!args.Has("model")) return Fail(cmd, "needs --model", 2);
  std::vector<double> ratios, alphas;
  if (!ParseList(args.Get("partial_ratio", "0.1,0.2,0.3"), &ratios)) {
    return Fail(cmd, "--partial_ratio: a comma-separated list of numbers in (0, 1]", 2);
  }
  if (!ParseList(args.Get("alpha", "2,4,6"), &alphas)) {
    return Fail(cmd, "--alpha: a comma-separated list of numbers > 0", 2);
  }
  auto m = model::Model::Load(args.Get("model"));
  if (!m.ok()) return Fail(cmd, std::string(m.status().message()), 1);
  const std::string file = args.Get("conversations", "traces/stories260k_chats.jsonl");
  auto cs = refengine::LoadConversations(file);
  if (!cs.ok()) return Fail(cmd, std::string(cs.status().message()), 2);
  if (auto s = refengine::CheckConversations(*cs, (*m)->config()); !s.ok()) {
    return Fail(cmd, std::string(s.message()), 2);
  }
  std::vector<std::vector<eval::SpecRound>> convs;
  for (const auto& c : *cs) {
    std::vector<eval::SpecRound> rounds;
    for (const auto& r : c.rounds) rounds.push_back({r.user, r.assistant});
    convs.push_back(std::move(rounds));
  }
  std::vector<spec::SkewModel> skews;
  if (args.Has("skew")) {
    auto s = spec::LoadSkew(args.Get("skew"));
    if (!s.ok()) return Fail(cmd, std::string(s.status().message()), 2);
    skews.push_back(std::move(*s));
  } else {
    auto text = SampledText(**m, 4, 1);
    if (!text.ok()) return Fail(cmd, std::string(text.status().message()), 1);
    for (double r : ratios) {
      if (!(r > 0 && r <= 1)) return Fail(cmd, "--partial_ratio values must be in (0, 1]", 2);
      std::fprintf(stderr, "calibrating at partial ratio %g on 4 sampled sequences...\n", r);
      auto s = eval::CalibrateSkew(**m, *text, r, args.Get("model"), nullptr);
      if (!s.ok()) return Fail(cmd, std::string(s.status().message()), 1);
      skews.push_back(std::move(*s));
    }
  }
  const int budget = static_cast<int>(args.GetU64("budget", 0));
  const bool oracle = args.Get("oracle", "false") == "true";
  std::unique_ptr<std::ofstream> csv;
  if (args.Has("csv")) {
    csv = std::make_unique<std::ofstream>(args.Get("csv"));
    *csv << "partial_ratio,alpha,budget,layer,hit,mass,tokens_kept,top1,kl,attn_rel_err,"
            "bytes_dense,bytes_speculative\n";
  }
  const int L = (*m)->config().n_layers;
  std::printf("%s on %s (%zu conversations), teacher-forced; budget %s; %s\n\n", file.c_str(),
              args.Get("model").c_str(), convs.size(),
              budget > 0 ? absl::StrCat(budget).c_str() : "none",
              oracle ? "ORACLE: each layer speculates with its own query"
                     : "the query approximated from the previous layer's input");
  std::string head = absl::StrFormat("%5s %5s", "ratio", "alpha");
  for (int l = 1; l < L; ++l) head += absl::StrFormat("  %10s", absl::StrCat("hit/n L", l));
  head += absl::StrFormat("  %6s %8s %9s %9s", "top-1", "KL", "attn err", "bytes");
  std::printf("%s\n", head.c_str());
  for (const spec::SkewModel& s : skews) {
    for (double a : alphas) {
      spec::SpeculationParams p;
      p.alpha = static_cast<float>(a);
      p.budget = budget;
      auto r = eval::EvaluateSpeculation(**m, s, convs, p, oracle);
      if (!r.ok()) return Fail(cmd, std::string(r.status().message()), 2);
      std::string row = absl::StrFormat("%5.2f %5.1f", s.partial_ratio, a);
      for (int l = 1; l < L; ++l) {
        row += absl::StrFormat("  %5.3f/%4.1f", r->layers[l].hit, r->layers[l].n);
      }
      row += absl::StrFormat("  %6.3f %8.4f %9.4f %8.3fx", r->top1, r->kl, r->attn_rel_err,
                             r->bytes_speculative / r->bytes_dense);
      std::printf("%s\n", row.c_str());
      if (csv) {
        for (int l = 1; l < L; ++l) {
          *csv << s.partial_ratio << "," << a << "," << budget << "," << l << ","
               << r->layers[l].hit << "," << r->layers[l].mass << "," << r->layers[l].n << ","
               << r->top1 << "," << r->kl << "," << r->attn_rel_err << "," << r->bytes_dense << ","
               << r->bytes_speculative << "\n";
        }
      }
    }
  }
  std::printf(
      "\nhit/n: per layer, the share of the true top-n attention mass that the n speculated\n"
      "tokens per head cover, and n (mean). bytes: K/V bytes read per decode token with\n"
      "speculation (partial keys of every token, K and V of the speculated ones) against\n"
      "dense attention over every token, fp32, same run. Layer 0 runs dense.\n");
  return 0;
}

}  // namespace kvtier::cli
