// `kvtier eval codecs`: the codec fidelity table (docs/codecs.md).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "eval/codec_eval.h"
#include "eval/eviction_eval.h"
#include "eval/evolkv.h"
#include "refengine/replay.h"
#include "tools/cli_args.h"

namespace kvtier::cli {
namespace {

constexpr char kHelp[] =
    "kvtier eval codecs [flags]\n"
    "  Measures every codec setting on each trace: compression ratio (against fp16, all\n"
    "  metadata included), K and V relative Frobenius error, attention-output error for the\n"
    "  trace's decode queries, and on a model the teacher-forced KL and top-1 agreement.\n\n"
    "  --model=PATH        a GGUF file (llama, gemma3) or llama2.c checkpoint (e.g.\n"
    "                      ../shared/models/stories260K.bin): adds\n"
    "                      a model trace and the KL/top-1 columns\n"
    "  --sequences=N       sequences sampled from the model for KL (default 4)\n"
    "  --seq_len=N         tokens per sequence (default: 512, or the model's context if shorter)\n"
    "  --queries=N         decode queries at the end of the model trace (default 32)\n"
    "  --synthetic=BOOL    include the synthetic-realistic trace (default true)\n"
    "  --synthetic_layers=N, --synthetic_rounds=N, --head_dim=N (defaults 2, 8, 128)\n"
    "  --import=PATH       add a trace from a .npy directory or .safetensors dump\n"
    "  --settings=A,B,...  codec settings (default: a sweep of raw, KIVI, KCVT, GEAR, GEAR-L;\n"
    "                      syntax in docs/codecs.md, e.g. kivi2:g=32, gear2:r=2:s=0.01)\n"
    "  --residual=R        full-precision newest tokens for every setting (default 0)\n"
    "  --block=NB          streaming block n_b for every setting (default 64)\n"
    "  --seed=S            sampling and synthetic seed (default 1)\n"
    "  --csv=FILE          also write one CSV row per (trace, setting)\n";

// A trace name from a checkpoint path: "../m/stories260K.bin" -> "stories260K".
std::string ModelStem(const std::string& path) {
  std::string stem = path.substr(path.find_last_of('/') + 1);
  return stem.substr(0, stem.find('.'));
}

int Usage(const std::string& msg) {
  std::fprintf(stderr, "kvtier eval: %s\n\n%s", msg.c_str(), kHelp);
  return 2;
}

int EvalCodecs(const Args& args) {
  const std::vector<std::string> unknown =
      args.Unknown({"model", "sequences", "seq_len", "queries", "synthetic", "synthetic_layers",
                    "synthetic_rounds", "head_dim", "import", "settings", "residual", "block",
                    "seed", "csv", "help"});
  if (!unknown.empty()) return Usage("unknown flag --" + unknown[0]);
  if (args.Has("help")) {
    std::printf("%s", kHelp);
    return 0;
  }
  std::vector<std::string> names = eval::DefaultCodecSettings();
  if (args.Has("settings")) names = absl::StrSplit(args.Get("settings"), ',', absl::SkipEmpty());
  std::vector<CodecConfig> configs;
  for (const std::string& n : names) {
    auto c = ParseCodecSetting(n);
    if (!c.ok()) return Usage(std::string(c.status().message()));
    if (args.Has("residual")) c->residual_tokens = static_cast<int>(args.GetU64("residual", 0));
    c->block_tokens =
        static_cast<int>(args.GetU64("block", c->block_tokens > 0 ? c->block_tokens : 64));
    configs.push_back(*c);
  }
  const uint64_t seed = args.GetU64("seed", 1);
  std::vector<traces::KvTrace> trace_list;
  std::unique_ptr<model::Model> model;
  std::vector<std::vector<int>> seqs;
  if (args.Has("model")) {
    auto m = model::Model::Load(args.Get("model"));
    if (!m.ok()) return Usage(std::string(m.status().message()));
    model = std::move(*m);
    const int len =
        static_cast<int>(args.GetU64("seq_len", std::min(model->config().seq_len, 512)));
    const int nseq = static_cast<int>(args.GetU64("sequences", 4));
    for (int i = 0; i < nseq; ++i) {
      auto s = model::SampleTokens(*model, len, seed + i);
      if (!s.ok()) return Usage(std::string(s.status().message()));
      seqs.push_back(*s);
    }
    const std::string stem = ModelStem(args.Get("model"));
    auto t = traces::CaptureModelTrace(*model, seqs[0],
                                       static_cast<int>(args.GetU64("queries", 32)), stem);
    if (!t.ok()) return Usage(std::string(t.status().message()));
    trace_list.push_back(std::move(*t));
    std::fprintf(stderr,
                 "model %s: %d layers, %d/%d heads, head_dim %d; %zu sequences of %d tokens\n",
                 args.Get("model").c_str(), model->config().n_layers, model->config().n_heads,
                 model->config().n_kv_heads, model->config().head_dim(), seqs.size(), len);
  }
  if (args.Get("synthetic", "true") != "false") {
    traces::SyntheticOptions o;
    o.layers = static_cast<int>(args.GetU64("synthetic_layers", 2));
    o.rounds = static_cast<int>(args.GetU64("synthetic_rounds", 8));
    o.head_dim = static_cast<int>(args.GetU64("head_dim", 128));
    o.seed = seed;
    auto t = traces::MakeSyntheticTrace(o);
    if (!t.ok()) return Usage(std::string(t.status().message()));
    trace_list.push_back(std::move(*t));
  }
  if (args.Has("import")) {
    auto t = traces::LoadTraceDump(args.Get("import"));
    if (!t.ok()) return Usage(std::string(t.status().message()));
    trace_list.push_back(std::move(*t));
  }
  if (trace_list.empty()) return Usage("no traces: pass --model, --import or --synthetic=true");
  std::unique_ptr<std::ofstream> csv;
  if (args.Has("csv")) {
    csv = std::make_unique<std::ofstream>(args.Get("csv"));
    if (!*csv) return Usage("cannot write --csv file " + args.Get("csv"));
    *csv << eval::CsvHeader() << "\n";
  }
  std::printf("%-16s %-26s %7s %9s %9s %10s %10s %7s\n", "trace", "setting", "ratio", "k_err",
              "v_err", "attn_err", "kl", "top1");
  const size_t total = trace_list.size() * configs.size();
  size_t done = 0;
  for (const traces::KvTrace& t : trace_list) {
    const bool is_model = model != nullptr && &t == &trace_list[0];
    for (const CodecConfig& c : configs) {
      const auto start = std::chrono::steady_clock::now();
      std::fprintf(stderr, "[%zu/%zu] %s on %s (%lld tokens x %d layers)...", ++done, total,
                   CodecSettingName(c).c_str(), t.name.c_str(), static_cast<long long>(t.tokens),
                   t.layers);
      auto row = eval::EvalCodecOnTrace(t, c);
      if (!row.ok()) {
        std::fprintf(stderr, "\n");
        return Usage(std::string(row.status().message()));
      }
      if (is_model) {
        auto kl = eval::EvalCodecOnModel(*model, seqs, c);
        if (!kl.ok()) {
          std::fprintf(stderr, "\n");
          return Usage(std::string(kl.status().message()));
        }
        row->kl = kl->first;
        row->top1_agree = kl->second;
      }
      std::fprintf(stderr, " %.1fs\n",
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      std::printf("%-16s %-26s %7.3f %9.5f %9.5f %10.5f %10.5f %7.4f\n", t.name.c_str(),
                  row->setting.c_str(), row->compression_ratio, row->k_rel_err, row->v_rel_err,
                  row->attn_rel_err, row->kl, row->top1_agree);
      std::fflush(stdout);
      if (csv) *csv << eval::CsvRow(*row) << "\n";
    }
  }
  return 0;
}

constexpr char kEvictionHelp[] =
    "kvtier eval eviction [flags]\n"
    "  Every eviction method at every per-head budget, side by side: on a model, the\n"
    "  teacher-forced KL and top-1 agreement against the full cache after evicting once at\n"
    "  the end of the prompt; on the synthetic trace, L1 eviction loss and relative\n"
    "  attention-output error for its decode queries.\n\n"
    "  --model=PATH        a GGUF file or llama2.c checkpoint (e.g. "
    "../shared/models/stories260K.bin)\n"
    "  --sequences=N       held-out sequences sampled from the model (default 4; seeds\n"
    "                      1000+, disjoint from the EvolKV search's)\n"
    "  --seq_len=N         tokens per sequence (default 512)   --prompt=N (default 384)\n"
    "  --budgets=A,B,...   per-head budgets, window included (default 16,32,64,128)\n"
    "  --methods=A,B,...   default streaming,h2o,snapkv,pyramidkv,ada-snapkv,ada-pyramid\n"
    "  --profiles=F,...    EvolKV layer-profile files to add (kvtier budgets search)\n"
    "  --synthetic=BOOL    include the synthetic trace (default true); --synthetic_layers=N\n"
    "                      (default 1)\n"
    "  --kvgroup=BOOL      also the synthetic variant whose concentrations differ per KV\n"
    "                      head rather than per query head (default true)\n"
    "  --model_trace=BOOL  with --model, also L1 loss and attention error on a trace captured\n"
    "                      from the first held-out sequence (default true)\n"
    "  --oracle=BOOL       add '+oracle' rows for the SnapKV family on traces: scores from\n"
    "                      the real decode queries instead of the observation window\n"
    "                      (analysis only; default true)\n"
    "  --csv=FILE          one row per (trace, method, budget)\n"
    "  The observation window is min(32, budget / 4) so every budget is valid.\n";

int EvalEviction(const Args& args) {
  const std::vector<std::string> unknown = args.Unknown(
      {"model", "sequences", "seq_len", "prompt", "budgets", "methods", "profiles", "synthetic",
       "synthetic_layers", "kvgroup", "model_trace", "oracle", "csv", "help"});
  if (!unknown.empty()) return Usage("unknown flag --" + unknown[0]);
  if (args.Has("help")) {
    std::printf("%s", kEvictionHelp);
    return 0;
  }
  std::vector<int64_t> budgets;
  for (absl::string_view b :
       absl::StrSplit(args.Get("budgets", "16,32,64,128"), ',', absl::SkipEmpty())) {
    int64_t v;
    if (!absl::SimpleAtoi(b, &v) || v < 4) return Usage("budgets must be integers >= 4");
    budgets.push_back(v);
  }
  const std::vector<std::string> methods =
      absl::StrSplit(args.Get("methods", "streaming,h2o,snapkv,pyramidkv,ada-snapkv,ada-pyramid"),
                     ',', absl::SkipEmpty());
  struct Entry {
    std::string method;
    int64_t budget;
    evict::Policy policy;
  };
  std::vector<Entry> entries;
  for (int64_t b : budgets) {
    for (const std::string& m : methods) {
      auto p = evict::ParsePolicy(absl::StrCat(m, ":", b, ":w=", std::min<int64_t>(32, b / 4)));
      if (!p.ok()) return Usage(std::string(p.status().message()));
      entries.push_back({m, b, *p});
    }
  }
  if (args.Has("profiles")) {
    for (absl::string_view f : absl::StrSplit(args.Get("profiles"), ',', absl::SkipEmpty())) {
      auto prof = evict::LoadLayerProfile(std::string(f));
      if (!prof.ok()) return Usage(std::string(prof.status().message()));
      int64_t sum = 0;
      for (int64_t b : prof->layer_budgets) sum += b;
      const int64_t mean = sum / static_cast<int64_t>(prof->layer_budgets.size());
      auto p =
          evict::ParsePolicy(absl::StrCat("profile:", f, ":w=", std::min<int64_t>(32, mean / 4)));
      if (!p.ok()) return Usage(std::string(p.status().message()));
      entries.push_back({"evolkv:" + prof->profile_name, mean, *p});
    }
  }
  std::unique_ptr<std::ofstream> csv;
  if (args.Has("csv")) {
    csv = std::make_unique<std::ofstream>(args.Get("csv"));
    if (!*csv) return Usage("cannot write --csv file " + args.Get("csv"));
    *csv << "trace,method,budget,budget_frac,l1_loss,attn_rel_err,kl,top1_agree\n";
  }
  std::printf("%-22s %-28s %6s %8s %9s %9s %9s %7s\n", "trace", "method", "budget", "frac",
              "l1_loss", "attn_err", "kl", "top1");
  auto emit = [&](const std::string& trace, const Entry& e, double frac, double l1, double rel,
                  double kl, double top1) {
    std::printf("%-22s %-28s %6lld %8.4f %9.5f %9.5f %9.5f %7.4f\n", trace.c_str(),
                e.method.c_str(), static_cast<long long>(e.budget), frac, l1, rel, kl, top1);
    std::fflush(stdout);
    if (csv) {
      *csv << trace << "," << e.method << "," << e.budget << "," << eval::CsvCell(frac, "%.5f")
           << "," << eval::CsvCell(l1) << "," << eval::CsvCell(rel) << "," << eval::CsvCell(kl)
           << "," << eval::CsvCell(top1, "%.4f") << "\n";
    }
  };
  const bool oracle = args.Get("oracle", "true") != "false";
  // L1 loss and attention error on a trace, and the oracle-window rows.
  auto run_trace = [&](const traces::KvTrace& t) -> int {
    size_t done = 0;
    for (const Entry& e : entries) {
      if (e.policy.method == evict::Method::kProfile &&
          static_cast<int>(e.policy.layer_budgets.size()) != t.layers) {
        continue;  // A model's profile does not fit the trace's layer count.
      }
      std::fprintf(stderr, "[%zu/%zu] %s:%lld on %s\n", ++done, entries.size(), e.method.c_str(),
                   static_cast<long long>(e.budget), t.name.c_str());
      const double frac = static_cast<double>(e.budget) / t.tokens;
      auto r = eval::EvalEvictionOnTrace(t, e.policy);
      if (!r.ok()) return Usage(std::string(r.status().message()));
      emit(t.name, e, frac, r->l1, r->rel, NAN, NAN);
      const evict::Method m = e.policy.method;
      if (oracle && m != evict::Method::kStreaming && m != evict::Method::kH2o) {
        auto o = eval::EvalEvictionOnTrace(t, e.policy, /*oracle=*/true);
        if (!o.ok()) return Usage(std::string(o.status().message()));
        Entry oe = e;
        oe.method += "+oracle";
        emit(t.name, oe, frac, o->l1, o->rel, NAN, NAN);
      }
    }
    return 0;
  };
  size_t done = 0;
  if (args.Has("model")) {
    auto m = model::Model::Load(args.Get("model"));
    if (!m.ok()) return Usage(std::string(m.status().message()));
    const int len = static_cast<int>(args.GetU64("seq_len", 512));
    const int prompt = static_cast<int>(args.GetU64("prompt", 384));
    if (prompt < 8 || prompt + 2 > len) return Usage("--prompt must be in [8, seq_len - 2]");
    std::vector<std::vector<int>> seqs;
    for (uint64_t i = 0; i < args.GetU64("sequences", 4); ++i) {
      auto s = model::SampleTokens(**m, len, 1000 + i);
      if (!s.ok()) return Usage(std::string(s.status().message()));
      seqs.push_back(*s);
    }
    const std::string stem = ModelStem(args.Get("model"));
    for (const Entry& e : entries) {
      std::fprintf(stderr, "[%zu/%zu] %s:%lld on %s\n", ++done, entries.size(), e.method.c_str(),
                   static_cast<long long>(e.budget), stem.c_str());
      auto r = eval::EvalEvictionOnModel(**m, seqs, prompt, e.policy);
      if (!r.ok()) return Usage(std::string(r.status().message()));
      emit(stem, e, static_cast<double>(e.budget) / prompt, NAN, NAN, r->kl, r->top1);
    }
    if (args.Get("model_trace", "true") != "false") {
      // The prompt's K/V and per-token queries, and the full-cache queries of
      // the positions after it as decode queries.
      auto t = traces::CaptureModelTrace(**m, seqs[0], len - prompt, stem + "-trace");
      if (!t.ok()) return Usage(std::string(t.status().message()));
      if (int rc = run_trace(*t); rc != 0) return rc;
    }
  }
  if (args.Get("synthetic", "true") != "false") {
    for (bool group : {false, true}) {
      if (group && args.Get("kvgroup", "true") == "false") continue;
      traces::SyntheticOptions o;
      o.layers = static_cast<int>(args.GetU64("synthetic_layers", 1));
      o.token_queries = true;
      o.group_concentration = group;
      auto t = traces::MakeSyntheticTrace(o);
      if (!t.ok()) return Usage(std::string(t.status().message()));
      if (int rc = run_trace(*t); rc != 0) return rc;
    }
  }
  return 0;
}

constexpr char kBudgetsHelp[] =
    "kvtier budgets search --model=PATH --out=FILE [flags]\n"
    "  EvolKV: searches per-layer budgets with CMA-ES (groups of n_g layers, bottom first)\n"
    "  to minimize the teacher-forced KL against the full cache plus lambda * (1 -\n"
    "  CacheScore), then completes them to a mean of exactly --budget. Writes a layer\n"
    "  profile that policies name as profile:FILE. Deterministic for a seed.\n\n"
    "  --budget=C          target mean per-head budget, window included (default 64)\n"
    "  --group=N           layers per CMA-ES group, n_g (default 1)\n"
    "  --lambda=X --gamma=X   penalty weight (default 1) and CacheScore softness (0.5)\n"
    "  --evals=N           objective evaluations per group (default 60)\n"
    "  --sequences=N       search sequences sampled with seeds 1..N (default 2)\n"
    "  --conversations=FILE  search on conversations instead (docs/replay.md's JSON Lines):\n"
    "                      the first seq_len tokens of --sequences of them, after --skip\n"
    "  --skip=N            conversations of FILE left out of the search (default 0), e.g.\n"
    "                      the ones a later check replays\n"
    "  --seq_len=N --prompt=N  (defaults 512, 384)   --seed=S (default 1)\n"
    "  On a model with sliding-window layers only the global layers are searched; the\n"
    "  others keep the mean in the profile (the worker never evicts a sliding layer).\n";

int BudgetsSearch(const Args& args) {
  const std::vector<std::string> unknown =
      args.Unknown({"model", "out", "budget", "group", "lambda", "gamma", "evals", "sequences",
                    "seq_len", "prompt", "seed", "conversations", "skip", "help"});
  if (!unknown.empty()) return Usage("unknown flag --" + unknown[0]);
  if (args.Has("help") || !args.Has("model") || !args.Has("out")) {
    std::printf("%s", kBudgetsHelp);
    return args.Has("help") ? 0 : 2;
  }
  auto m = model::Model::Load(args.Get("model"));
  if (!m.ok()) return Usage(std::string(m.status().message()));
  eval::EvolKvOptions o;
  o.mean_budget = static_cast<int64_t>(args.GetU64("budget", 64));
  o.group_layers = static_cast<int>(args.GetU64("group", 1));
  o.evals_per_group = static_cast<int>(args.GetU64("evals", 60));
  o.prompt = static_cast<int>(args.GetU64("prompt", 384));
  o.seed = args.GetU64("seed", 1);
  if (args.Has("lambda") && !absl::SimpleAtod(args.Get("lambda"), &o.lambda))
    return Usage("bad --lambda");
  if (args.Has("gamma") && !absl::SimpleAtod(args.Get("gamma"), &o.gamma))
    return Usage("bad --gamma");
  const int len = static_cast<int>(args.GetU64("seq_len", 512));
  if (o.prompt < 8 || o.prompt + 2 > len) return Usage("--prompt must be in [8, seq_len - 2]");
  std::vector<std::vector<int>> seqs;
  const uint64_t count = args.GetU64("sequences", 2);
  std::string source = absl::StrCat(count, " sampled sequences");
  if (args.Has("conversations")) {
    auto convs = refengine::LoadConversations(args.Get("conversations"));
    if (!convs.ok()) return Usage(std::string(convs.status().message()));
    const uint64_t skip = args.GetU64("skip", 0);
    if (skip + count > convs->size()) {
      return Usage(absl::StrCat("--skip=", skip, " --sequences=", count, " needs ", skip + count,
                                " conversations; ", args.Get("conversations"), " has ",
                                convs->size()));
    }
    for (uint64_t i = skip; i < skip + count; ++i) {
      std::vector<int> s;
      for (const refengine::ReplayRound& r : (*convs)[i].rounds) {
        s.insert(s.end(), r.user.begin(), r.user.end());
        s.insert(s.end(), r.assistant.begin(), r.assistant.end());
      }
      if (static_cast<int>(s.size()) < len) {
        return Usage(absl::StrCat((*convs)[i].where, ": ", s.size(),
                                  " tokens, shorter than --seq_len=", len));
      }
      s.resize(len);
      seqs.push_back(std::move(s));
    }
    source = absl::StrCat("conversations ", skip, "-", skip + count - 1, " of ",
                          args.Get("conversations"));
  } else {
    for (uint64_t i = 0; i < count; ++i) {
      auto s = model::SampleTokens(**m, len, 1 + i);
      if (!s.ok()) return Usage(std::string(s.status().message()));
      seqs.push_back(*s);
    }
  }
  std::fprintf(stderr, "EvolKV on %s: %s, %d tokens each, evicted after %d\n",
               args.Get("model").c_str(), source.c_str(), len, o.prompt);
  auto r = eval::SearchLayerBudgets(
      **m, seqs, o, [](const std::string& msg) { std::fprintf(stderr, "%s\n", msg.c_str()); });
  if (!r.ok()) return Usage(std::string(r.status().message()));
  const std::string name = absl::StrCat("evolkv-c", o.mean_budget, "-seed", o.seed);
  if (auto s = evict::SaveLayerProfile(args.Get("out"), name, r->budgets); !s.ok()) {
    return Usage(std::string(s.message()));
  }
  std::printf(
      "profile %s -> %s\nbudgets %s (searched layers %s)\nsearch-set KL: profile %.5f, uniform "
      "snapkv:%lld %.5f (%d evaluations)\n",
      name.c_str(), args.Get("out").c_str(), absl::StrJoin(r->budgets, " ").c_str(),
      absl::StrJoin(r->searched_layers, " ").c_str(), r->kl, static_cast<long long>(o.mean_budget),
      r->uniform_kl, r->evals);
  return 0;
}

}  // namespace

int BudgetsCommand(const Args& args) {
  if (!args.positional().empty() && args.positional()[0] == "search") return BudgetsSearch(args);
  std::printf("%s", kBudgetsHelp);
  return args.positional().empty() || args.positional()[0] != "help" ? 2 : 0;
}

int EvalWatershed(const Args& args);    // tools/eval_watershed.cc
int EvalSpeculation(const Args& args);  // tools/speculation_commands.cc

int EvalCommand(const Args& args) {
  if (args.positional().empty() || args.positional()[0] == "help") {
    std::printf(
        "%s\nAlso: kvtier eval eviction --help, kvtier eval watershed --help, kvtier eval "
        "speculation --help\n",
        kHelp);
    return args.positional().empty() ? 2 : 0;
  }
  if (args.positional()[0] == "codecs") return EvalCodecs(args);
  if (args.positional()[0] == "eviction") return EvalEviction(args);
  if (args.positional()[0] == "watershed") return EvalWatershed(args);
  if (args.positional()[0] == "speculation") return EvalSpeculation(args);
  return Usage("unknown eval '" + args.positional()[0] +
               "' (codecs, eviction, watershed, speculation)");
}

}  // namespace kvtier::cli
