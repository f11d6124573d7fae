// `kvtier policy ...`: register and read kvtier-controller's per-model
// policies from the shell.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/controller_client.h"
#include "encoded/encode.h"
#include "google/protobuf/text_format.h"
#include "kernels/codec.h"
#include "kernels/eviction.h"
#include "kernels/recall.h"
#include "kernels/speculation.h"
#include "rpc/policy_proto.h"
#include "tools/cli_args.h"
#include "worker/engine.h"

namespace kvtier::cli {
namespace {

constexpr char kHelp[] =
    "kvtier policy SUBCOMMAND [flags]\n"
    "\n"
    "Common flags:\n"
    "  --controller=HOST:PORT  kvtier-controller (default $KVTIER_CONTROLLER or 127.0.0.1:7072)\n"
    "  --token=TOKEN           bearer token (default $KVTIER_TOKEN); set needs a node token\n"
    "  --tls_ca=FILE           PEM roots: use TLS and verify the controller with them\n"
    "  --tls_cert=FILE, --tls_key=FILE  this client's certificate and key, for a\n"
    "                          controller that requires one (--tls_client_ca)\n"
    "\n"
    "Subcommands:\n"
    "  set --model=NAME [policy flags]\n"
    "      Registers what sessions of model NAME (ModelSpec.name) get when they open\n"
    "      without a Policy. Replaces the model's earlier policy. Policy flags:\n"
    "        --codec=SETTING  as CODEC in make demo and Policy(codec=...) in Python:\n"
    "                         raw, fp16, kivi4, kivi2, gear2, kcvt4, gear2:r=2 ...; or a\n"
    "                         family (raw|kivi|kcvt|gear|gear-l) with --bits\n"
    "        --bits=N  --group_size=N  --residual_tokens=N  (override the setting's)\n"
    "        --eviction=none|streaming|h2o|snapkv|pyramidkv|ada-snapkv|ada-pyramidkv\n"
    "                         (also ada-pyramid, streamingllm) with --budget_tokens\n"
    "        --budget_tokens=B  --window=W\n"
    "        --recall=all|topk:K|adaptive:L|threshold:T|mass:P\n"
    "        --watershed_layer=L  --keep_recent_round=true|false\n"
    "        --release_after_end_round=true|false\n"
    "        --profile=FILE   an EvolKV layer profile (kvtier budgets search --out=FILE)\n"
    "        --speculation_skew=FILE|ID  InfiniGen speculation with this skew (kvtier\n"
    "                         calibrate infinigen; a file gives its id). Workers load it\n"
    "                         with --skew_dir, or an engine uploads it (PutSkew)\n"
    "        --speculation_alpha=A  keep tokens within A of the max score [4]\n"
    "        --speculation_budget=N  at most N tokens per head, 0 = no cap [0]\n"
    "        --speculation_pool_bytes=N  cap on a session's host pool (past rounds'\n"
    "                         K/V at layers 1..L-1); EndRound evicts the least fetched\n"
    "                         tokens of the older half above it, 0 = no cap [0]\n"
    "        --speculation_pool_low_bytes=N  where such a trim stops (at most the cap):\n"
    "                         room for the next rounds, so fewer trims; 0 = the cap [0]\n"
    "  get --model=NAME [--session=S] [--idle_ms=N] [--format=summary|proto]\n"
    "      What GetPolicy answers for a session of that model idle N ms: the registered\n"
    "      policy, or the tightened one for a cold session under memory pressure,\n"
    "      with every default filled in (summary, the default), or the answer as\n"
    "      protobuf text (proto).\n";

int Usage(const std::string& why) {
  std::fprintf(stderr, "kvtier policy: %s (kvtier policy help lists the flags)\n", why.c_str());
  return 2;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvtier policy: %s\n", s.ToString().c_str());
  return 1;
}

bool ParseCodec(const std::string& name, v1::Codec* out) {
  static const std::pair<const char*, v1::Codec> kCodecs[] = {{"raw", v1::CODEC_RAW},
                                                              {"kivi", v1::CODEC_KIVI},
                                                              {"kcvt", v1::CODEC_KCVT},
                                                              {"gear", v1::CODEC_GEAR},
                                                              {"gear-l", v1::CODEC_GEAR_L}};
  for (const auto& [n, c] : kCodecs) {
    if (absl::AsciiStrToLower(name) == n) {
      *out = c;
      return true;
    }
  }
  return false;
}

// One line of what a session of the model runs with, every default filled
// in, in the names --codec, --eviction and --recall take.
std::string Summary(const v1::GetPolicyResponse& r) {
  absl::StatusOr<worker::SessionPolicy> p = PolicyFromAnswer(r);
  if (!p.ok()) return "the answer does not convert: " + p.status().ToString();
  std::string s = absl::StrCat(
      "codec=", CodecSettingName(p->codec), " recall=", RecallName(p->recall),
      " eviction=", evict::PolicyName(p->eviction), " watershed_layer=",
      p->watershed_layer < 0 ? std::string("default (L/3)") : absl::StrCat(p->watershed_layer),
      " keep_recent_round=", p->keep_recent_round ? "true" : "false",
      " release_after_end_round=", p->release_after_end_round ? "true" : "false");
  if (!p->speculation.skew.empty()) {
    absl::StrAppend(&s, " speculation=", p->speculation.skew, " alpha=", p->speculation.alpha,
                    " budget=", p->speculation.budget);
  }
  std::string level = absl::AsciiStrToLower(v1::PressureLevel_Name(r.pressure()));
  if (level.rfind("pressure_", 0) == 0) level = level.substr(9);
  absl::StrAppend(&s, "\npressure: ", level,
                  r.tightened() ? "; tightened (a cold session under pressure: fewer bits, half "
                                  "the eviction budgets)"
                                : "");
  return s + "\n";
}

bool ParseBool(const std::string& v, bool* out) {
  if (v != "true" && v != "false") return false;
  *out = v == "true";
  return true;
}

std::string Env(const char* name, const std::string& def) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : def;
}

}  // namespace

int PolicyCommand(const Args& args) {
  const std::string sub = args.positional().empty() ? "help" : args.positional()[0];
  if (sub == "help" || args.Has("help")) {
    std::printf("%s", kHelp);
    return 0;
  }
  const std::vector<std::string> unknown = args.Unknown({"controller",
                                                         "token",
                                                         "tls_ca",
                                                         "tls_cert",
                                                         "tls_key",
                                                         "model",
                                                         "codec",
                                                         "bits",
                                                         "group_size",
                                                         "residual_tokens",
                                                         "eviction",
                                                         "budget_tokens",
                                                         "window",
                                                         "recall",
                                                         "watershed_layer",
                                                         "keep_recent_round",
                                                         "release_after_end_round",
                                                         "profile",
                                                         "session",
                                                         "idle_ms",
                                                         "speculation_skew",
                                                         "speculation_alpha",
                                                         "speculation_budget",
                                                         "speculation_pool_bytes",
                                                         "speculation_pool_low_bytes",
                                                         "format"});
  if (!unknown.empty()) return Usage("unknown flag --" + unknown.front());
  if (!args.Has("model")) return Usage("--model=NAME is required");
  ControllerClientOptions o;
  o.target = args.Get("controller", Env("KVTIER_CONTROLLER", "127.0.0.1:7072"));
  o.token = args.Get("token", Env("KVTIER_TOKEN", ""));
  if (std::string error;
      !ReadClientTls(args, &o.tls_root_certs, &o.tls_cert_chain, &o.tls_private_key, &error)) {
    return Usage(error);
  }
  absl::StatusOr<std::unique_ptr<ControllerClient>> c = ControllerClient::Connect(o);
  if (!c.ok()) return Fail(c.status());

  if (sub == "get") {
    v1::GetPolicyRequest req;
    req.set_session_id(args.Get("session", "kvtier-policy-get"));
    req.mutable_model()->set_name(args.Get("model"));
    req.set_idle_ms(args.GetU64("idle_ms", 0));
    absl::StatusOr<v1::GetPolicyResponse> r = (*c)->GetPolicy(req);
    if (!r.ok()) return Fail(r.status());
    const std::string format = args.Get("format", "summary");
    if (format == "proto") {
      std::string text;
      google::protobuf::TextFormat::PrintToString(*r, &text);
      std::printf("%s", text.c_str());
    } else if (format == "summary") {
      std::printf("model %s: %s", args.Get("model").c_str(), Summary(*r).c_str());
    } else {
      return Usage("--format is summary or proto, not " + format);
    }
    return 0;
  }
  if (sub != "set") return Usage("unknown subcommand '" + sub + "'");

  v1::SetPolicyRequest req;
  req.set_model_name(args.Get("model"));
  v1::Policy& p = *req.mutable_policy();
  v1::CodecParams& cp = *p.mutable_codec_params();
  if (args.Has("codec")) {
    // A family name (its bits from --bits), or a setting as the demo and
    // the Python client take it (kivi4, gear2:r=2, fp16, ...).
    v1::Codec codec;
    if (ParseCodec(args.Get("codec"), &codec)) {
      p.set_codec(codec);
    } else {
      absl::StatusOr<CodecConfig> c = ParseCodecSetting(args.Get("codec"));
      if (!c.ok()) return Usage("--codec: " + std::string(c.status().message()));
      p.set_codec(ToProto(c->codec));
      cp = ToParams(*c);
    }
  }
  if (args.Has("bits")) cp.set_bits(static_cast<uint32_t>(args.GetU64("bits", 0)));
  if (args.Has("group_size")) {
    cp.set_group_size(static_cast<uint32_t>(args.GetU64("group_size", 0)));
  }
  if (args.Has("residual_tokens")) {
    cp.set_residual_tokens(static_cast<uint32_t>(args.GetU64("residual_tokens", 0)));
  }
  if (args.Has("eviction")) {
    const std::string e = args.Get("eviction");
    // Checked here as the worker checks it, so a typo fails before the call.
    if (e.rfind("profile", 0) == 0) {
      return Usage("--eviction: a layer profile is --profile=FILE (kvtier budgets search --out)");
    }
    if (e != "none") {
      if (absl::StatusOr<evict::Policy> m = evict::ParsePolicy(e + ":64"); !m.ok()) {
        return Usage("--eviction: " + std::string(m.status().message()));
      }
      if (!args.Has("budget_tokens")) return Usage("--eviction=" + e + " needs --budget_tokens");
    }
    p.set_eviction(e);
  }
  p.set_budget_tokens(static_cast<uint32_t>(args.GetU64("budget_tokens", 0)));
  p.set_window(static_cast<uint32_t>(args.GetU64("window", 0)));
  if (args.Has("recall")) {
    if (absl::StatusOr<RecallStrategy> r = ParseRecall(args.Get("recall")); !r.ok()) {
      return Usage("--recall: " + std::string(r.status().message()));
    }
    p.set_recall(args.Get("recall"));
  }
  p.set_watershed_layer(static_cast<uint32_t>(args.GetU64("watershed_layer", 0)));
  for (const char* flag : {"keep_recent_round", "release_after_end_round"}) {
    if (!args.Has(flag)) continue;
    bool v;
    if (!ParseBool(args.Get(flag), &v)) return Usage(std::string("--") + flag + " is true|false");
    if (std::string(flag) == "keep_recent_round") {
      p.set_keep_recent_round(v);
    } else {
      p.set_release_after_end_round(v);
    }
  }
  if (args.Has("speculation_skew")) {
    const std::string v = args.Get("speculation_skew");
    std::string id = v;
    if (std::FILE* f = std::fopen(v.c_str(), "rb")) {
      std::string bytes;
      char buf[1 << 16];
      size_t n;
      while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) bytes.append(buf, n);
      std::fclose(f);
      // The skew must parse here as the workers will parse it.
      if (absl::StatusOr<spec::SkewModel> m = spec::ParseSkew(bytes); !m.ok()) {
        return Fail(absl::Status(m.status().code(), v + ": " + std::string(m.status().message())));
      }
      id = worker::SkewRegistry::Id(bytes);
      std::printf("skew %s is %s\n", v.c_str(), id.c_str());
    }
    p.set_speculation_skew(id);
  }
  if (args.Has("speculation_alpha")) {
    float alpha = 0;
    if (!absl::SimpleAtof(args.Get("speculation_alpha"), &alpha) || !(alpha > 0)) {
      return Usage("--speculation_alpha must be a number above 0");
    }
    p.set_speculation_alpha(alpha);
  }
  p.set_speculation_budget(static_cast<uint32_t>(args.GetU64("speculation_budget", 0)));
  p.set_speculation_pool_bytes(args.GetU64("speculation_pool_bytes", 0));
  p.set_speculation_pool_low_bytes(args.GetU64("speculation_pool_low_bytes", 0));
  if ((args.Has("speculation_alpha") || args.Has("speculation_budget") ||
       args.Has("speculation_pool_bytes") || args.Has("speculation_pool_low_bytes")) &&
      !args.Has("speculation_skew")) {
    return Usage(
        "--speculation_alpha, --speculation_budget, --speculation_pool_bytes and "
        "--speculation_pool_low_bytes need --speculation_skew");
  }
  if (p.speculation_pool_low_bytes() > p.speculation_pool_bytes()) {
    return Usage("--speculation_pool_low_bytes must be at most --speculation_pool_bytes");
  }
  if (args.Has("profile")) {
    absl::StatusOr<evict::Policy> prof = evict::LoadLayerProfile(args.Get("profile"));
    if (!prof.ok()) return Fail(prof.status());
    for (int64_t b : prof->layer_budgets) req.add_layer_budgets(static_cast<uint32_t>(b));
    req.set_profile_name(prof->profile_name);
  }
  absl::StatusOr<v1::SetPolicyResponse> r = (*c)->SetPolicy(req);
  if (!r.ok()) return Fail(r.status());
  std::printf("%s the policy of model '%s'\n", r->replaced() ? "replaced" : "registered",
              req.model_name().c_str());
  return 0;
}

}  // namespace kvtier::cli
