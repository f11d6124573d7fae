// `kvtier store ...`: talk to a kvtier-store from the shell.
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/store_client.h"
#include "encoded/encoded_tensor.h"
#include "tools/cli_args.h"

namespace kvtier::cli {
namespace {

constexpr char kHelp[] =
    "kvtier store SUBCOMMAND [flags]\n"
    "\n"
    "Common flags:\n"
    "  --target=HOST:PORT   store address (default $KVTIER_STORE or 127.0.0.1:7070)\n"
    "  --token=TOKEN        bearer token (default $KVTIER_TOKEN; none if unset)\n"
    "  --tls_ca=FILE        PEM roots: use TLS and verify the store with them\n"
    "  --tls_cert=FILE, --tls_key=FILE  this client's certificate and key, for a store\n"
    "                       that requires one (--tls_client_ca)\n"
    "\n"
    "Subcommands:\n"
    "  put   --session=S --round=R [--segment=G] --layers=B:E\n"
    "        (--file=PAYLOAD | --tokens=N [--kv_heads=4] [--head_dim=64] [--seed=1])\n"
    "        [--question_tokens=Q] [--ttl=SECONDS]\n"
    "        Uploads a serialized SegmentPayload, or a synthetic raw fp16 K and V block of\n"
    "        shape [layers, kv_heads, tokens, head_dim].\n"
    "  get   --session=S --refs=R:G[,R:G...] [--out=DIR]   one batched GetSegments call\n"
    "  ls    --session=S                                   rounds, segments, tiers, recalls\n"
    "  drop  --session=S --rounds=R[,R...]\n"
    "  rm    --session=S\n"
    "  pin   --session=S [--unpin]\n"
    "  sessions [--idle_for=AGE]                           the tenant's sessions, idle time, size\n"
    "  gc    --idle_for=AGE [--dry_run] [--include_pinned]\n"
    "        Deletes the tenant's sessions idle for at least AGE (e.g. 36h, 90m, 7d): the ones\n"
    "        a client or a worker never closed. Pinned sessions are kept unless asked.\n"
    "  stats\n";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvtier store: %s\n", s.ToString().c_str());
  return 1;
}

int Usage(const std::string& why) {
  std::fprintf(stderr, "kvtier store: %s\n\n%s", why.c_str(), kHelp);
  return 2;
}

const char* StateName(v1::SegmentState s) {
  switch (s) {
    case v1::SEGMENT_STATE_SEALED:
      return "sealed(ram)";
    case v1::SEGMENT_STATE_SPILLED:
      return "spilled(disk)";
    case v1::SEGMENT_STATE_WRITING:
      return "writing";
    default:
      return "?";
  }
}

std::string HumanBytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
  return buf;
}

// A raw fp16 tensor [layers, kv_heads, tokens, head_dim] of small random
// values (bit patterns of N(0,1) rounded to half precision).
v1::EncodedTensor SyntheticTensor(v1::TensorRole role, uint32_t layers, uint32_t layer_begin,
                                  uint64_t kv_heads, uint64_t tokens, uint64_t head_dim,
                                  std::mt19937_64& rng) {
  v1::EncodedTensor t;
  t.set_codec(v1::CODEC_RAW);
  t.set_role(role);
  t.set_dtype(v1::DTYPE_FP16);
  t.set_layer_begin(layer_begin);
  for (uint64_t d : {uint64_t{layers}, kv_heads, tokens, head_dim}) t.add_shape(d);
  const uint64_t n = uint64_t{layers} * kv_heads * tokens * head_dim;
  std::string data(n * 2, '\0');
  std::normal_distribution<float> normal;
  for (uint64_t i = 0; i < n; ++i) {
    float f = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    // fp32 -> fp16 for |f| in the normal range (truncating the mantissa).
    uint16_t sign = (bits >> 16) & 0x8000;
    int exp = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
    uint16_t h = exp <= 0    ? sign
                 : exp >= 31 ? (sign | 0x7bff)
                             : (sign | (exp << 10) | ((bits >> 13) & 0x3ff));
    std::memcpy(&data[i * 2], &h, 2);
  }
  auto* b = t.add_buffers();
  b->set_kind(v1::BUFFER_RAW);
  b->set_data(std::move(data));
  SealTensor(&t);
  return t;
}

bool ParseRange(const std::string& s, uint32_t* a, uint32_t* b) {
  std::vector<std::string> p = absl::StrSplit(s, ':');
  return p.size() == 2 && absl::SimpleAtoi(p[0], a) && absl::SimpleAtoi(p[1], b);
}

// "36h", "90m", "45s", "7d" (days, which absl does not parse).
bool ParseAge(const std::string& text, absl::Duration* out) {
  if (!text.empty() && text.back() == 'd') {
    uint64_t days;
    if (!absl::SimpleAtoi(text.substr(0, text.size() - 1), &days) || days > 100000) return false;
    *out = absl::Hours(24) * static_cast<int64_t>(days);
    return true;
  }
  return absl::ParseDuration(text, out) && *out >= absl::ZeroDuration();
}

}  // namespace

int StoreCommand(const Args& args) {
  if (args.positional().empty() || args.positional()[0] == "help") {
    std::printf("%s", kHelp);
    return args.positional().empty() ? 2 : 0;
  }
  const std::string sub = args.positional()[0];
  std::vector<std::string> unknown = args.Unknown(
      {"target", "token", "tls_ca", "tls_cert", "tls_key",  "session", "round",           "segment",
       "layers", "file",  "tokens", "kv_heads", "head_dim", "seed",    "question_tokens", "ttl",
       "refs",   "out",   "rounds", "unpin",    "idle_for", "dry_run", "include_pinned"});
  if (!unknown.empty()) return Usage("unknown flag --" + unknown[0]);

  StoreClientOptions o;
  const char* env_target = std::getenv("KVTIER_STORE");
  const char* env_token = std::getenv("KVTIER_TOKEN");
  o.target = args.Get("target", env_target != nullptr ? env_target : "127.0.0.1:7070");
  o.token = args.Get("token", env_token != nullptr ? env_token : "");
  if (std::string error;
      !ReadClientTls(args, &o.tls_root_certs, &o.tls_cert_chain, &o.tls_private_key, &error)) {
    return Usage(error);
  }
  auto client_or = StoreClient::Connect(o);
  if (!client_or.ok()) return Fail(client_or.status());
  StoreClient& client = **client_or;
  const std::string session = args.Get("session");
  if (sub != "stats" && sub != "gc" && sub != "sessions" && session.empty()) {
    return Usage(sub + " needs --session");
  }

  if (sub == "put") {
    PutSegmentArgs a;
    a.session_id = session;
    a.round = static_cast<uint32_t>(args.GetU64("round", 0));
    a.segment = static_cast<uint32_t>(args.GetU64("segment", 0));
    if (args.Has("ttl")) a.session_ttl_seconds = static_cast<uint32_t>(args.GetU64("ttl", 0));
    if (!ParseRange(args.Get("layers"), &a.layer_begin, &a.layer_end)) {
      return Usage("put needs --layers=BEGIN:END");
    }
    std::string payload;
    if (args.Has("file")) {
      std::ifstream in(args.Get("file"), std::ios::binary);
      if (!in) return Usage("cannot read --file");
      std::stringstream ss;
      ss << in.rdbuf();
      payload = ss.str();
    } else if (args.Has("tokens")) {
      std::mt19937_64 rng(args.GetU64("seed", 1));
      const uint64_t tokens = args.GetU64("tokens", 0);
      const uint64_t heads = args.GetU64("kv_heads", 4), dim = args.GetU64("head_dim", 64);
      const uint32_t layers = a.layer_end > a.layer_begin ? a.layer_end - a.layer_begin : 0;
      if (tokens == 0 || heads == 0 || dim == 0 || layers == 0) {
        return Usage("--tokens, --kv_heads, --head_dim and the layer range must be positive");
      }
      v1::SegmentPayload p;
      *p.add_tensors() =
          SyntheticTensor(v1::TENSOR_ROLE_KEY, layers, a.layer_begin, heads, tokens, dim, rng);
      *p.add_tensors() =
          SyntheticTensor(v1::TENSOR_ROLE_VALUE, layers, a.layer_begin, heads, tokens, dim, rng);
      payload = p.SerializeAsString();
    } else {
      return Usage("put needs --file or --tokens");
    }
    v1::RoundSummary summary;
    if (args.Has("question_tokens")) {
      summary.set_question_tokens(static_cast<uint32_t>(args.GetU64("question_tokens", 0)));
      summary.set_token_end(args.GetU64("tokens", 0));
      a.round_summary = &summary;
    }
    auto t0 = std::chrono::steady_clock::now();
    auto r = client.PutSegment(a, payload);
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (!r.ok()) return Fail(r.status());
    std::printf("put  %s round %u segment %u  layers [%u,%u)  %s  %s  %.1f ms (durable)\n",
                session.c_str(), a.round, a.segment, a.layer_begin, a.layer_end,
                HumanBytes(payload.size()).c_str(), StateName(r->segment().state()), ms);
    return 0;
  }
  if (sub == "get") {
    std::vector<v1::SegmentRef> refs;
    for (absl::string_view part : absl::StrSplit(args.Get("refs"), ',', absl::SkipEmpty())) {
      uint32_t rnd, seg;
      if (!ParseRange(std::string(part), &rnd, &seg)) return Usage("--refs wants R:G,R:G,...");
      v1::SegmentRef ref;
      ref.set_round(rnd);
      ref.set_segment(seg);
      refs.push_back(ref);
    }
    if (refs.empty()) return Usage("get needs --refs");
    if (args.Has("out")) {
      // Created (with its parents) up front, so that a bad --out fails
      // before the fetch rather than after it, silently.
      std::error_code ec;
      std::filesystem::create_directories(args.Get("out"), ec);
      if (ec || !std::filesystem::is_directory(args.Get("out"))) {
        std::fprintf(stderr, "kvtier store get: --out=%s is not a directory we can create: %s\n",
                     args.Get("out").c_str(), ec ? ec.message().c_str() : "a file is in the way");
        return 1;
      }
    }
    auto t0 = std::chrono::steady_clock::now();
    auto got = client.GetSegments(session, refs);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!got.ok()) return Fail(got.status());
    uint64_t total = 0;
    for (const FetchedSegment& f : *got) {
      auto parsed = ParseAndValidatePayload(f.payload);
      std::printf("got  %s round %u segment %u  %s from %s  crc32c ok  %d tensors%s\n",
                  session.c_str(), f.info.ref().round(), f.info.ref().segment(),
                  HumanBytes(f.payload.size()).c_str(),
                  f.served_from == v1::TIER_RAM ? "RAM" : "RocksDB",
                  parsed.ok() ? parsed->tensors_size() : 0,
                  parsed.ok() ? "" : (" INVALID: " + parsed.status().ToString()).c_str());
      total += f.payload.size();
      if (args.Has("out")) {
        std::string path = args.Get("out") + "/" + session + "-r" +
                           std::to_string(f.info.ref().round()) + "-s" +
                           std::to_string(f.info.ref().segment()) + ".segment";
        std::ofstream file(path, std::ios::binary);
        file << f.payload;
        file.close();
        if (!file) {
          std::fprintf(stderr, "kvtier store get: writing %s failed: %s\n", path.c_str(),
                       std::strerror(errno));
          return 1;
        }
        std::printf("     wrote %s\n", path.c_str());
      }
    }
    std::printf("one GetSegments call: %zu segments, %s in %.1f ms (%.2f GB/s)\n", got->size(),
                HumanBytes(total).c_str(), s * 1e3, total / s / 1e9);
    return 0;
  }
  if (sub == "ls") {
    auto list = client.ListRounds(session);
    if (!list.ok()) return Fail(list.status());
    std::printf("session %s  pinned=%s  ttl=%us\n", session.c_str(), list->pinned() ? "yes" : "no",
                list->ttl_seconds());
    std::printf("%6s %8s %10s %14s %12s %8s\n", "round", "segment", "layers", "state", "bytes",
                "recalls");
    for (const auto& r : list->rounds()) {
      for (const auto& s : r.segments()) {
        std::printf("%6u %8u %4u..%-4u %14s %12s %8lu\n", r.round(), s.ref().segment(),
                    s.layer_begin(), s.layer_end(), StateName(s.state()),
                    HumanBytes(s.payload_bytes()).c_str(),
                    static_cast<unsigned long>(r.summary().recall_count()));
      }
    }
    return 0;
  }
  if (sub == "drop") {
    std::vector<uint32_t> rounds;
    for (absl::string_view part : absl::StrSplit(args.Get("rounds"), ',', absl::SkipEmpty())) {
      uint32_t r;
      if (!absl::SimpleAtoi(part, &r)) return Usage("--rounds wants R,R,...");
      rounds.push_back(r);
    }
    auto d = client.DropRounds(session, rounds);
    if (!d.ok()) return Fail(d.status());
    std::printf("dropped %d rounds (%s freed), %d not found\n", d->dropped_size(),
                HumanBytes(d->freed_bytes()).c_str(), d->not_found_size());
    return 0;
  }
  if (sub == "rm") {
    auto d = client.DeleteSession(session);
    if (!d.ok()) return Fail(d.status());
    std::printf("deleted %s: %u rounds, %s freed\n", session.c_str(), d->rounds_deleted(),
                HumanBytes(d->freed_bytes()).c_str());
    return 0;
  }
  if (sub == "pin") {
    absl::Status s = client.PinSession(session, !args.Has("unpin"));
    if (!s.ok()) return Fail(s);
    std::printf("%s %s\n", session.c_str(), args.Has("unpin") ? "unpinned" : "pinned");
    return 0;
  }
  if (sub == "sessions" || sub == "gc") {
    absl::Duration idle = absl::ZeroDuration();
    if (args.Has("idle_for") && !ParseAge(args.Get("idle_for"), &idle)) {
      return Usage("--idle_for wants an age such as 36h, 90m or 7d");
    }
    if (sub == "gc" && !args.Has("idle_for")) return Usage("gc needs --idle_for");
    const bool dry = args.Has("dry_run");
    const bool pinned_too = args.Has("include_pinned");
    v1::ListSessionsRequest req;
    req.set_min_idle_seconds(static_cast<uint64_t>(absl::ToInt64Seconds(idle)));
    uint64_t listed = 0, deleted = 0, kept = 0, freed = 0;
    if (sub == "sessions") {
      std::printf("%-40s %10s %7s %12s %7s %10s\n", "session", "idle", "rounds", "bytes", "pinned",
                  "ttl");
    }
    do {
      auto page = client.ListSessions(req);
      if (!page.ok()) return Fail(page.status());
      for (const v1::SessionSummary& s : page->sessions()) {
        ++listed;
        if (sub == "sessions") {
          std::printf("%-40s %9lus %7u %12s %7s %9us\n", s.session_id().c_str(),
                      static_cast<unsigned long>(s.idle_seconds()), s.rounds(),
                      HumanBytes(s.bytes()).c_str(), s.pinned() ? "yes" : "no", s.ttl_seconds());
          continue;
        }
        if (s.pinned() && !pinned_too) {
          ++kept;
          continue;
        }
        std::printf("%s %s  idle %lus  %u rounds  %s\n", dry ? "would delete" : "delete",
                    s.session_id().c_str(), static_cast<unsigned long>(s.idle_seconds()),
                    s.rounds(), HumanBytes(s.bytes()).c_str());
        if (dry) {
          freed += s.bytes();
          continue;
        }
        auto d = client.DeleteSession(s.session_id());
        if (!d.ok() && d.status().code() != absl::StatusCode::kNotFound) return Fail(d.status());
        if (d.ok()) {
          ++deleted;
          freed += d->freed_bytes();
        }
      }
      req.set_start_after(page->next_start_after());
    } while (!req.start_after().empty());
    if (sub == "gc") {
      std::printf("%lu sessions idle for %s or more: %s %lu (%s), kept %lu pinned\n",
                  static_cast<unsigned long>(listed), absl::FormatDuration(idle).c_str(),
                  dry ? "would delete" : "deleted",
                  static_cast<unsigned long>(dry ? listed - kept : deleted),
                  HumanBytes(freed).c_str(), static_cast<unsigned long>(kept));
    }
    return 0;
  }
  if (sub == "stats") {
    auto st = client.Stats();
    if (!st.ok()) return Fail(st.status());
    for (const auto& t : st->tiers()) {
      std::printf("tier %-5s %12s in %6lu segments  (budget %s)\n",
                  t.tier() == v1::TIER_RAM ? "ram" : "disk", HumanBytes(t.bytes()).c_str(),
                  static_cast<unsigned long>(t.segments()),
                  t.budget_bytes() ? HumanBytes(t.budget_bytes()).c_str() : "unlimited");
    }
    std::printf(
        "sessions %lu  hits ram %lu disk %lu  spills %lu  promotions %lu  drops %lu  "
        "expired %lu\ntenant %s: %s in %lu sessions (quota %s)\n",
        static_cast<unsigned long>(st->sessions()), static_cast<unsigned long>(st->hits_ram()),
        static_cast<unsigned long>(st->hits_disk()), static_cast<unsigned long>(st->spills()),
        static_cast<unsigned long>(st->promotions()), static_cast<unsigned long>(st->drops()),
        static_cast<unsigned long>(st->expired_sessions()), st->tenant().c_str(),
        HumanBytes(st->tenant_bytes()).c_str(), static_cast<unsigned long>(st->tenant_sessions()),
        st->tenant_quota_bytes() ? HumanBytes(st->tenant_quota_bytes()).c_str() : "none");
    return 0;
  }
  return Usage("unknown subcommand '" + sub + "'");
}

}  // namespace kvtier::cli
