// The demo's report: the text a person reads (RenderText) and the JSON a
// script reads (RenderJson), from a DemoReport.
#include <algorithm>
#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "kernels/crc32c.h"
#include "kernels/speculation.h"
#include "refengine/demo.h"

namespace kvtier::refengine {
namespace {

std::string Mib(uint64_t b) { return absl::StrFormat("%.2f MiB", b / 1048576.0); }
std::string Kib(double b) { return absl::StrFormat("%.1f KiB", b / 1024.0); }

// Totals over sessions and rounds.
struct Totals {
  uint64_t full = 0, ws = 0;          // Final round of each session.
  uint64_t full_all = 0, ws_all = 0;  // Summed over every round.
  uint64_t stored = 0, fetched = 0;
  int64_t round_count = 0, recalls = 0, selected = 0, candidates = 0, fetches = 0;
  int64_t refs = 0, refs_hit = 0;
  double fetch_ms = 0, exposed_ms = 0, tier_ms = 0, local_ms = 0;
  int64_t decode_tokens = 0;
  double err2 = 0, ref2 = 0;
  double top1 = 0, kl = 0;
  // The largest peak RSS any worker reported, with that report; and each
  // session's largest working set, summed (what the sessions held at most
  // together).
  v1::ProcessMemory worker_memory;
  uint64_t ws_peak_sum = 0;
};

Totals Sum(const DemoReport& r) {
  Totals t;
  for (const DemoSession& s : r.sessions) {
    if (!s.rounds.empty()) {
      t.full += s.rounds.back().full_cache_bytes;
      t.ws += s.rounds.back().round_working_set_bytes;
    }
    uint64_t ws_peak = 0;
    for (const TierRound& tr : s.rounds) {
      ws_peak = std::max(ws_peak, tr.round_working_set_bytes);
      if (tr.worker_memory.peak_resident_bytes() >= t.worker_memory.peak_resident_bytes()) {
        t.worker_memory = tr.worker_memory;
      }
    }
    t.ws_peak_sum += ws_peak;
    for (size_t i = 0; i < s.rounds.size(); ++i) {
      const TierRound& tr = s.rounds[i];
      t.full_all += tr.full_cache_bytes;
      t.ws_all += tr.round_working_set_bytes;
      t.stored += tr.stored_bytes;
      t.fetched += tr.bytes_fetched;
      ++t.round_count;
      if (tr.recalled) {
        ++t.recalls;
        t.selected += static_cast<int64_t>(tr.selected.size());
        t.candidates += static_cast<int64_t>(tr.scores.size());
      }
      if (tr.fetched_segments > 0) {
        ++t.fetches;
        t.fetch_ms += tr.fetch_ms;
        t.exposed_ms += tr.exposed_ms;
      }
      if (i < s.references.size()) {
        for (int ref : s.references[i]) {
          ++t.refs;
          t.refs_hit +=
              std::count(tr.selected.begin(), tr.selected.end(), static_cast<uint32_t>(ref)) > 0;
        }
      }
    }
    t.tier_ms += s.tier_decode_ms;
    t.local_ms += s.local_decode_ms;
    t.decode_tokens += s.decode_tokens;
    t.err2 += s.err2;
    t.ref2 += s.ref2;
    t.top1 += s.agreement.top1;
    t.kl += s.agreement.kl;
  }
  if (!r.sessions.empty()) {
    t.top1 /= static_cast<double>(r.sessions.size());
    t.kl /= static_cast<double>(r.sessions.size());
  }
  return t;
}

bool Synthetic(const DemoReport& r) { return r.workload == "synthetic-chat"; }

// A replay's sums over rounds (one session's, or every session's).
struct ReplayTotals {
  int64_t rounds = 0, user = 0, assistant = 0, agree = 0, scored = 0, tier = 0, local = 0;
  double kl = 0;
  void Add(const ReplayRoundScore& x) {
    ++rounds;
    user += x.user_tokens;
    assistant += x.assistant_tokens;
    agree += x.top1_agree;
    kl += x.kl_sum;
    scored += x.scored;
    tier += x.tier_correct;
    local += x.local_correct;
  }
};

ReplayTotals SumReplay(const DemoReport& r) {
  ReplayTotals t;
  for (const DemoSession& d : r.sessions) {
    for (const ReplayRoundScore& x : d.replay) t.Add(x);
  }
  return t;
}

// Per-round lines of the text report for this many conversations (the JSON
// report has every one).
constexpr size_t kReplayRoundsShown = 8;

double Ratio(double a, double b) { return b > 0 ? a / b : 0; }

std::string Acc(int64_t correct, int64_t n) {
  return n > 0 ? absl::StrFormat("%.3f", static_cast<double>(correct) / n) : std::string("-");
}

// Questions about earlier rounds, as text: what the full cache and the tier
// answer over each scored span, and the totals.
std::string RenderAnswers(const DemoReport& r) {
  int n = 0, full = 0, tier = 0;
  std::string lines;
  for (size_t i = 0; i < r.sessions.size(); ++i) {
    for (const DemoSession::Answer& a : r.sessions[i].answers) {
      ++n;
      full += a.full_cache_right;
      tier += a.kvtier_right;
      if (i >= kReplayRoundsShown) continue;
      std::string q = absl::StrReplaceAll(a.question, {{"\n", " / "}});
      absl::StrAppendFormat(&lines, "  %s round %d: %s\n", r.sessions[i].conversation, a.round, q);
      absl::StrAppendFormat(&lines, "      expect %-12s full cache%-7s %s\n", JsonQuote(a.expect),
                            a.full_cache_right ? " (right)" : " (wrong)", JsonQuote(a.full_cache));
      absl::StrAppendFormat(&lines, "      %-19s kvtier%-11s %s\n", "",
                            a.kvtier_right ? " (right)" : " (wrong)", JsonQuote(a.kvtier));
    }
  }
  if (n == 0) return "";
  return absl::StrFormat(
      "\nquestions about earlier rounds (%d): kvtier right %d, full cache right %d (right: the "
      "greedy tokens over the scored span, teacher-forced, contain the stated value)\n%s",
      n, tier, full, lines);
}

// Below this top-1 agreement with the full cache the report says, in a line
// of its own, that the policy changes the model's answers.
constexpr double kFidelityWarnBelow = 0.95;

// That line, or nothing.
std::string FidelityWarning(double top1) {
  if (!(top1 < kFidelityWarnBelow)) return "";
  return absl::StrFormat(
      "warning: top-1 agreement %.3f is below %.2f: this policy changes the model's next token "
      "at %.1f%% of positions (docs/fidelity.md gives each method's cost on a real model)\n",
      top1, kFidelityWarnBelow, 100.0 * (1.0 - top1));
}

// The replay's part of the text report: agreement with the full cache on
// every assistant token, accuracy on the scored spans for both, then per
// round what the tier kept and moved.
std::string RenderReplay(const DemoReport& r) {
  const ReplayTotals t = SumReplay(r);
  std::string s;
  absl::StrAppendFormat(&s,
                        "fidelity against the full cache, every assistant token (teacher-forced "
                        "on the file's): top-1 agreement %s, KL %.4f nats\n",
                        Acc(t.agree, t.assistant), Ratio(t.kl, t.assistant));
  if (t.assistant > 0) s += FidelityWarning(Ratio(t.agree, t.assistant));
  if (t.scored > 0) {
    absl::StrAppendFormat(&s,
                          "accuracy on the scored spans (%lld tokens): kvtier %s, full cache %s "
                          "(the tier's cost: %+.3f)\n",
                          static_cast<long long>(t.scored), Acc(t.tier, t.scored),
                          Acc(t.local, t.scored),
                          static_cast<double>(t.tier - t.local) / static_cast<double>(t.scored));
  } else {
    s += "accuracy on the scored spans: the file scores no span\n";
  }
  absl::StrAppendFormat(&s, "\n%-26s %5s %9s %6s %7s %13s %7s %9s  %s\n", "conversation", "round",
                        "tokens", "top-1", "KL", "scored k/full", "ws/full", "fetched", "recalled");
  for (size_t i = 0; i < r.sessions.size(); ++i) {
    const DemoSession& d = r.sessions[i];
    if (i == kReplayRoundsShown) {
      absl::StrAppendFormat(&s, "  ... %zu more conversations in the JSON report (--report)\n",
                            r.sessions.size() - i);
      break;
    }
    ReplayTotals c;
    for (size_t j = 0; j < d.replay.size(); ++j) {
      const ReplayRoundScore& x = d.replay[j];
      c.Add(x);
      const TierRound* tr = j < d.rounds.size() ? &d.rounds[j] : nullptr;
      absl::StrAppendFormat(
          &s, "%-26s %5zu %4d+%-4d %6s %7.4f %13s %7s %9s  %s\n",
          j == 0 ? d.conversation.substr(0, 26) : "", j, x.user_tokens, x.assistant_tokens,
          Acc(x.top1_agree, x.assistant_tokens), Ratio(x.kl_sum, x.assistant_tokens),
          x.scored > 0 ? absl::StrCat(x.tier_correct, "/", x.local_correct, " of ", x.scored)
                       : std::string("-"),
          tr != nullptr
              ? absl::StrFormat("%.2f", Ratio(tr->round_working_set_bytes, tr->full_cache_bytes))
              : std::string("-"),
          tr != nullptr ? Kib(static_cast<double>(tr->bytes_fetched)) : std::string("-"),
          tr != nullptr && tr->recalled ? absl::StrCat("[", absl::StrJoin(tr->selected, " "), "]")
                                        : std::string("-"));
    }
    absl::StrAppendFormat(
        &s, "%-26s %5s %4lld+%-4lld %6s %7.4f %13s\n", "", "all", static_cast<long long>(c.user),
        static_cast<long long>(c.assistant), Acc(c.agree, c.assistant), Ratio(c.kl, c.assistant),
        c.scored > 0 ? absl::StrCat(c.tier, "/", c.local, " of ", c.scored) : std::string("-"));
  }
  s += RenderAnswers(r);
  return s;
}

// Speculation's figures per layer, summed over every session and round.
std::vector<v1::SpeculationLayer> SumSpeculation(const DemoReport& r) {
  std::vector<v1::SpeculationLayer> out(static_cast<size_t>(std::max(0, r.layers)));
  for (const DemoSession& d : r.sessions) {
    for (const TierRound& tr : d.rounds) {
      for (size_t l = 0; l < tr.speculation.size() && l < out.size(); ++l) {
        const v1::SpeculationLayer& x = tr.speculation[l];
        v1::SpeculationLayer& o = out[l];
        o.set_steps(o.steps() + x.steps());
        o.set_past_tokens(o.past_tokens() + x.past_tokens());
        o.set_kept(o.kept() + x.kept());
        o.set_gathered(o.gathered() + x.gathered());
        o.set_bytes_speculative(o.bytes_speculative() + x.bytes_speculative());
        o.set_bytes_dense(o.bytes_dense() + x.bytes_dense());
        o.set_sampled(o.sampled() + x.sampled());
        o.set_hit_sum(o.hit_sum() + x.hit_sum());
        o.set_mass_sum(o.mass_sum() + x.mass_sum());
      }
    }
  }
  return out;
}

// The host pool's trims, over every session and round.
struct PoolSum {
  uint64_t cap = 0, rounds = 0, trims = 0, evicted = 0, reencoded = 0;
  uint64_t max_before = 0, max_after = 0;
  double ms = 0;  // Summed over the trims.
};

PoolSum SumPool(const DemoReport& r) {
  PoolSum p;
  for (const DemoSession& d : r.sessions) {
    for (const TierRound& tr : d.rounds) {
      if (tr.pool.cap_bytes() == 0) continue;
      p.cap = tr.pool.cap_bytes();
      ++p.rounds;
      p.trims += tr.pool.evicted_tokens() > 0;
      p.evicted += tr.pool.evicted_tokens();
      p.reencoded += tr.pool.reencoded_layers();
      p.max_before = std::max(p.max_before, tr.pool.bytes_before());
      p.max_after = std::max(p.max_after, tr.pool.bytes_after());
      if (tr.pool.evicted_tokens() > 0) p.ms += tr.pool.ms();
    }
  }
  return p;
}

std::string RenderSpeculation(const DemoReport& r) {
  const std::vector<v1::SpeculationLayer> layers = SumSpeculation(r);
  int on_gpu = 0;
  for (const DemoSession& d : r.sessions) on_gpu += d.speculation_on_device ? 1 : 0;
  std::string s = absl::StrFormat(
      "\nspeculation on the %s\n",
      on_gpu == 0 ? "CPU (the worker has no GPU, or runs --placement=host)"
      : on_gpu == static_cast<int>(r.sessions.size())
          ? "GPU (past rounds in the host pool)"
          : absl::StrFormat("GPU for %d of %zu sessions", on_gpu, r.sessions.size()));
  s += absl::StrFormat(
      "speculation (%s), per decode step at each layer, over the past rounds (the open round "
      "is attended in full): past tokens, tokens kept per query head, tokens gathered per KV "
      "head (the union of its group's), hit rate, attention mass kept, K/V bytes read against "
      "dense:\n%-6s %7s %11s %11s %13s %9s %8s %10s\n",
      r.speculation, "layer", "steps", "past toks", "kept/head", "gathered/kvh", "hit rate", "mass",
      "K/V bytes");
  uint64_t spec = 0, dense = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    const v1::SpeculationLayer& x = layers[l];
    if (x.steps() == 0) {
      absl::StrAppendFormat(&s, "%-6zu %7s %11s %11s %13s %9s %8s %10s\n", l, "-", "-", "-", "-",
                            "-", "-", l == 0 ? "dense" : "-");
      continue;
    }
    spec += x.bytes_speculative();
    dense += x.bytes_dense();
    absl::StrAppendFormat(
        &s, "%-6zu %7llu %11.1f %11.1f %13.1f %9s %8s %9.3fx\n", l,
        static_cast<unsigned long long>(x.steps()), Ratio(x.past_tokens(), x.steps()),
        Ratio(x.kept(), x.steps()), Ratio(x.gathered(), x.steps() * std::max(1, r.kv_heads)),
        x.sampled() > 0 ? absl::StrFormat("%.3f", x.hit_sum() / x.sampled()) : std::string("-"),
        x.sampled() > 0 ? absl::StrFormat("%.3f", x.mass_sum() / x.sampled()) : std::string("-"),
        Ratio(x.bytes_speculative(), x.bytes_dense()));
  }
  absl::StrAppendFormat(&s,
                        "past-round K/V bytes read at speculating layers: %s against %s dense "
                        "(%.3fx); hit rate and mass on every 16th step\n",
                        Kib(static_cast<double>(spec)), Kib(static_cast<double>(dense)),
                        Ratio(spec, dense));
  const PoolSum pool = SumPool(r);
  if (pool.cap > 0) {
    absl::StrAppendFormat(
        &s,
        "host pool (cap %s per session, layers 1..%d): %llu of %llu EndRounds trimmed, %llu "
        "tokens evicted (summed over layers and KV heads), %llu round layers re-encoded, "
        "%.3f ms per trim; the largest pool before a trim %s, after %s\n",
        Kib(static_cast<double>(pool.cap)), r.layers - 1,
        static_cast<unsigned long long>(pool.trims), static_cast<unsigned long long>(pool.rounds),
        static_cast<unsigned long long>(pool.evicted),
        static_cast<unsigned long long>(pool.reencoded), Ratio(pool.ms, pool.trims),
        Kib(static_cast<double>(pool.max_before)), Kib(static_cast<double>(pool.max_after)));
  }
  return s;
}

// Process memory beside what the processes hold (docs/worker.md#memory).
std::string RenderMemory(const DemoReport& r, const Totals& t) {
  std::string s;
  const v1::ProcessMemory& w = t.worker_memory;
  if (w.peak_resident_bytes() > 0) {
    absl::StrAppendFormat(
        &s,
        "%s: peak RSS %s, %s at the last EndRound (heap %s in use, %s freed and kept); "
        "the sessions' working sets at their largest sum to %s (peak RSS %.1fx that)\n",
        r.inproc ? "this process (engine, its full-cache reference, in-process worker)"
                 : "kvtier-worker memory (largest worker)",
        Mib(w.peak_resident_bytes()), Mib(w.resident_bytes()), Mib(w.heap_in_use_bytes()),
        Mib(w.heap_free_bytes()), Mib(t.ws_peak_sum),
        Ratio(w.peak_resident_bytes(), t.ws_peak_sum));
  }
  if (r.store_memory.has_value() && r.store_memory->peak_resident_bytes() > 0) {
    const v1::ProcessMemory& m = *r.store_memory;
    absl::StrAppendFormat(&s,
                          "kvtier-store memory: RSS %s (peak %s; heap %s in use, %s freed and "
                          "kept) for %s in its RAM tier\n",
                          Mib(m.resident_bytes()), Mib(m.peak_resident_bytes()),
                          Mib(m.heap_in_use_bytes()), Mib(m.heap_free_bytes()),
                          Mib(r.store_bytes_ram.value_or(0)));
  }
  return s;
}

}  // namespace

uint32_t OutputsDigest(const DemoReport& r) {
  uint32_t d = 0;
  for (const DemoSession& s : r.sessions) {
    const unsigned char le[4] = {static_cast<unsigned char>(s.outputs_crc32c),
                                 static_cast<unsigned char>(s.outputs_crc32c >> 8),
                                 static_cast<unsigned char>(s.outputs_crc32c >> 16),
                                 static_cast<unsigned char>(s.outputs_crc32c >> 24)};
    d = Crc32cExtend(d, le, sizeof(le));
  }
  return d;
}

std::string RenderText(const DemoReport& r) {
  const Totals t = Sum(r);
  std::string s;
  absl::StrAppendFormat(&s, "\n== kvtier demo report: %s\n", r.workload);
  if (!r.conversations.empty()) {
    const ReplayTotals rt = SumReplay(r);
    absl::StrAppendFormat(&s,
                          "%zu conversations replayed from %s: %lld rounds, %lld user + %lld "
                          "assistant tokens; %d layers; %s; %.1f s\n\n",
                          r.sessions.size(), r.conversations, static_cast<long long>(rt.rounds),
                          static_cast<long long>(rt.user), static_cast<long long>(rt.assistant),
                          r.layers, r.policy, r.seconds);
  } else {
    absl::StrAppendFormat(&s, "%zu sessions x %d rounds x %d tokens; %d layers; %s; %.1f s\n\n",
                          r.sessions.size(), r.rounds, r.tokens_per_round, r.layers, r.policy,
                          r.seconds);
  }
  int on_gpu = 0, spec_on_gpu = 0;
  for (const DemoSession& d : r.sessions) {
    on_gpu += d.on_device ? 1 : 0;
    spec_on_gpu += d.speculation_on_device ? 1 : 0;
  }
  absl::StrAppendFormat(
      &s, "working sets: %s\n\n",
      on_gpu == 0 && spec_on_gpu > 0
          ? "host memory (speculating sessions keep their past rounds in the host pool; "
            "the GPU holds what they gather)"
      : on_gpu == 0 ? "host memory (the worker has no GPU, or runs --placement=host)"
      : on_gpu == static_cast<int>(r.sessions.size())
          ? "GPU memory"
          : absl::StrFormat("GPU memory for %d of %zu sessions", on_gpu, r.sessions.size()));
  if (r.decode_requests > 0) {
    absl::StrAppendFormat(&s,
                          "decode: one shared stream, %llu requests carried %llu session-layer "
                          "steps (%.2f per request)\n\n",
                          static_cast<unsigned long long>(r.decode_requests),
                          static_cast<unsigned long long>(r.decode_items),
                          static_cast<double>(r.decode_items) / r.decode_requests);
  }
  absl::StrAppendFormat(&s, "%-44s %14s %14s %7s\n", "device-side KV bytes (final round)",
                        "full cache", "kvtier", "ratio");
  for (const DemoSession& d : r.sessions) {
    if (d.rounds.empty()) continue;
    const TierRound& last = d.rounds.back();
    absl::StrAppendFormat(&s, "  %-42s %14s %14s %7.3f\n", d.id, Mib(last.full_cache_bytes),
                          Mib(last.round_working_set_bytes),
                          Ratio(last.round_working_set_bytes, last.full_cache_bytes));
  }
  absl::StrAppendFormat(&s, "  %-42s %14s %14s %7.3f\n", "all sessions", Mib(t.full), Mib(t.ws),
                        Ratio(t.ws, t.full));
  absl::StrAppendFormat(&s, "  %-42s %14s %14s %7.3f\n", "all sessions, every round (mean)", "", "",
                        Ratio(t.ws_all, t.full_all));
  s += "\n";
  if (r.store_bytes_ram.has_value()) {
    absl::StrAppendFormat(&s,
                          "kvtier-store: %s in the RAM tier (hot copies), %s in the RocksDB tier "
                          "(every acknowledged round)\n",
                          Mib(*r.store_bytes_ram), Mib(*r.store_bytes_disk));
  }
  s += RenderMemory(r, t);
  absl::StrAppendFormat(
      &s,
      "bytes moved per round (mean): %s stored (%d segments, ONE PutSegments), %s recalled "
      "(%lld of %lld rounds fetched, ONE GetSegments each)\n",
      Kib(Ratio(t.stored, t.round_count)), r.segments_per_round,
      Kib(Ratio(t.fetched, t.round_count)), static_cast<long long>(t.fetches),
      static_cast<long long>(t.round_count));
  absl::StrAppendFormat(&s,
                        "recall at layer %d: %lld recalls; %lld rounds selected of %lld candidates "
                        "(%.2f per recall, recent round included)\n",
                        r.watershed, static_cast<long long>(t.recalls),
                        static_cast<long long>(t.selected), static_cast<long long>(t.candidates),
                        Ratio(t.selected, t.recalls));
  if (t.refs > 0) {
    absl::StrAppendFormat(
        &s, "  rounds the questions refer to that were recalled: %lld of %lld (%.1f%%)\n",
        static_cast<long long>(t.refs_hit), static_cast<long long>(t.refs),
        100.0 * Ratio(t.refs_hit, t.refs));
  }
  if (t.fetches > 0) {
    absl::StrAppendFormat(&s,
                          "  recall fetch: %.2f ms per call, %.2f ms of it exposed (%.0f%% hidden "
                          "behind layer %d's attention and the engine's own work before layer "
                          "%d)\n",
                          t.fetch_ms / t.fetches, t.exposed_ms / t.fetches,
                          100.0 * std::max(0.0, 1.0 - Ratio(t.exposed_ms, t.fetch_ms)), r.watershed,
                          r.watershed + 1);
  }
  if (!r.sessions.empty()) {
    const DemoSession& d = r.sessions[0];
    absl::StrAppendFormat(&s, "  recalled rounds, %s:\n", d.id);
    for (size_t i = 0; i < d.rounds.size(); ++i) {
      const TierRound& tr = d.rounds[i];
      if (!tr.recalled) continue;
      std::string refs;
      if (i < d.references.size()) {
        refs = absl::StrCat("refers to [", absl::StrJoin(d.references[i], " "), "], ");
      }
      absl::StrAppendFormat(&s, "    round %2u: %srecalled [%s] of %zu\n", tr.round, refs,
                            absl::StrJoin(tr.selected, " "), tr.scores.size());
    }
  }
  {
    // Time to first token (the round's prefill step) and, disaggregated,
    // what each hand-off moved and cost.
    double prefill_ms = 0, xfer_ms = 0, exposed_ms = 0, back_ms = 0;
    uint64_t wire = 0, raw = 0, back = 0, reused = 0, back_reused = 0;
    int64_t n = 0, handed = 0;
    uint64_t device = 0, back_device = 0;
    double drain_ms = 0, import_ms = 0, copy_ms = 0, tail_wait_ms = 0;
    double recv_span_ms = 0, recv_busy_ms = 0;
    int links_reused = 0;
    std::map<std::string, int> paths;  // Hand-offs and hand-backs per path.
    std::string refusal;
    for (const DemoSession& d : r.sessions) {
      for (const TierRound& tr : d.rounds) {
        ++n;
        prefill_ms += tr.prefill_ms;
        if (!tr.handed_off) continue;
        ++handed;
        ++paths[tr.transfer_path];
        if (!tr.return_path.empty()) ++paths[tr.return_path];
        if (refusal.empty()) refusal = tr.device_refusal;
        device += tr.transfer_device_bytes;
        back_device += tr.return_device_bytes;
        links_reused += tr.nccl_links_reused;
        wire += tr.transfer_wire_bytes;
        raw += tr.transfer_raw_bytes;
        xfer_ms += tr.transfer_ms;
        exposed_ms += tr.transfer_exposed_ms;
        drain_ms += tr.transfer_drain_ms;
        import_ms += tr.transfer_import_ms;
        copy_ms += tr.transfer_device_copy_ms;
        tail_wait_ms += tr.transfer_tail_wait_ms;
        recv_span_ms += tr.transfer_receiver_span_ms;
        recv_busy_ms += tr.transfer_receiver_busy_ms;
        back += tr.return_wire_bytes;
        reused += tr.transfer_reused_bytes;
        back_reused += tr.return_reused_bytes;
        back_ms += tr.return_ms;
      }
    }
    absl::StrAppendFormat(&s,
                          "prefill (time to first token, less the first decode step): %.2f ms "
                          "per round (mean)\n",
                          Ratio(prefill_ms, n));
    if (handed > 0) {
      std::vector<std::string> counted;
      for (const auto& [p, c] : paths) counted.push_back(absl::StrCat(p, " ", c));
      const std::string path = absl::StrJoin(counted, ", ");
      absl::StrAppendFormat(
          &s,
          "prefill -> decode hand-off (paths, hand-offs and hand-backs: %s), per round (mean): "
          "%s sent of a %s state (%s "
          "of it still held by the decode worker; the state is %s in the model's dtype, "
          "%.2fx), %.2f ms, %.2f ms of it exposed (%.0f%% hidden behind the prefill); "
          "hand-back after EndRound: %s sent (%s more still held by the prefill worker), "
          "%.2f ms\n",
          path, Kib(Ratio(wire, handed)), Kib(Ratio(wire + reused, handed)),
          Kib(Ratio(reused, handed)), Kib(Ratio(raw, handed)), Ratio(raw, wire + reused),
          xfer_ms / handed, exposed_ms / handed,
          100.0 * std::max(0.0, 1.0 - Ratio(exposed_ms, xfer_ms)), Kib(Ratio(back, handed)),
          Kib(Ratio(back_reused, handed)), back_ms / handed);
      absl::StrAppendFormat(&s,
                            "  of the exposed part (mean): %.2f ms until the stream caught up "
                            "with the prefill, %.2f ms the tail waited behind layers the decode "
                            "worker was still taking, %.2f ms its import; the decode worker "
                            "took the stream in %.2f ms (header to tail), busy for %.2f ms of "
                            "them, %.2f ms of that on device copies and uploads\n",
                            drain_ms / handed, tail_wait_ms / handed, import_ms / handed,
                            recv_span_ms / handed, recv_busy_ms / handed, copy_ms / handed);
      if (device + back_device > 0) {
        std::vector<std::string> how;
        if (paths.count("cuda_ipc") > 0) how.push_back("CUDA IPC");
        if (paths.count("nccl") > 0) how.push_back("NCCL");
        absl::StrAppendFormat(&s,
                              "copied device to device (%s), per round (mean): %s in the "
                              "hand-off, %s in the hand-back (besides the bytes sent)\n",
                              absl::StrJoin(how, " and "), Kib(Ratio(device, handed)),
                              Kib(Ratio(back_device, handed)));
      }
      if (paths.count("nccl") > 0) {
        absl::StrAppendFormat(&s,
                              "NCCL communicators: %d of %d NCCL hand-offs and hand-backs used "
                              "one kept from an earlier one (the rest formed one)\n",
                              links_reused, paths["nccl"]);
      }
      if (!refusal.empty()) {
        absl::StrAppendFormat(&s, "device path not taken: %s\n", refusal);
      }
    }
  }
  absl::StrAppendFormat(
      &s, "%s: %.3f ms per token %s, %.3f ms in-process full cache\n",
      r.answer_prefill ? "answers (one prefill a round, --answer_prefill)" : "decode",
      Ratio(t.tier_ms, t.decode_tokens),
      r.inproc ? "with the worker engine in this process (the store remote)"
               : "through kvtier-worker (every layer over gRPC)",
      Ratio(t.local_ms, t.decode_tokens));
  int cached = 0;
  for (const DemoSession& d : r.sessions) cached += d.teacher_cached ? 1 : 0;
  if (cached > 0) {
    absl::StrAppendFormat(&s,
                          "full cache: read from --teacher_cache for %d of %zu conversations "
                          "(its time is the one measured when they were written)\n",
                          cached, r.sessions.size());
  }
  if (Synthetic(r)) {
    absl::StrAppendFormat(&s,
                          "fidelity: attention-output relative error %.5f (every layer, every "
                          "token, against the full fp32 cache)\n",
                          std::sqrt(Ratio(t.err2, t.ref2)));
    absl::StrAppendFormat(&s,
                          "outputs digest: %08x (CRC-32C of every attention output kvtier "
                          "returned; runs of this workload with equal digests returned "
                          "bit-identical outputs)\n",
                          OutputsDigest(r));
  } else if (r.conversations.empty()) {
    absl::StrAppendFormat(&s,
                          "fidelity: top-1 agreement %.3f, KL %.4f nats (teacher-forced on the "
                          "local greedy answers)\n",
                          t.top1, t.kl);
    s += FidelityWarning(t.top1);
  } else {
    s += RenderReplay(r);
  }
  if (!r.speculation.empty()) s += RenderSpeculation(r);
  bool cluster = false;
  for (const DemoSession& d : r.sessions) cluster = cluster || !d.worker.empty();
  if (cluster) {
    s += "\ncluster placement (where each session ended) and failovers:\n";
    for (const DemoSession& d : r.sessions) {
      absl::StrAppendFormat(&s, "  %-24s worker %-10s stores %s\n", d.id, d.worker,
                            absl::StrJoin(d.stores, ","));
      for (const Failover& f : d.failovers) {
        absl::StrAppendFormat(&s, "    round %u: %s -> %s in %.0f ms (%s)\n", f.round, f.from, f.to,
                              f.recover_ms, f.failure);
      }
    }
  }
  return s;
}

std::string RenderJson(const DemoReport& r) {
  const Totals t = Sum(r);
  auto num = [](double x) { return absl::StrFormat("%.6g", x); };
  auto opt = [](const std::optional<uint64_t>& x) {
    return x.has_value() ? absl::StrCat(*x) : std::string("null");
  };
  std::string s = "{\n";
  absl::StrAppend(&s, "  \"workload\": ", JsonQuote(r.workload), ",\n");
  absl::StrAppend(&s, "  \"answer_prefill\": ", r.answer_prefill ? "true" : "false", ",\n");
  absl::StrAppend(&s, "  \"policy\": \"", r.policy, "\",\n");
  absl::StrAppend(&s, "  \"mode\": \"", r.inproc ? "inproc" : "remote", "\",\n");
  absl::StrAppend(&s, "  \"sessions\": ", r.sessions.size(), ",\n");
  absl::StrAppend(&s, "  \"rounds\": ", r.rounds, ",\n");
  absl::StrAppend(&s, "  \"tokens_per_round\": ", r.tokens_per_round, ",\n");
  absl::StrAppend(&s, "  \"layers\": ", r.layers, ",\n");
  absl::StrAppend(&s, "  \"watershed_layer\": ", r.watershed, ",\n");
  absl::StrAppend(&s, "  \"full_cache_bytes\": ", t.full, ",\n");
  absl::StrAppend(&s, "  \"working_set_bytes\": ", t.ws, ",\n");
  int on_gpu = 0;
  for (const DemoSession& d : r.sessions) on_gpu += d.on_device ? 1 : 0;
  absl::StrAppend(&s, "  \"working_set_sessions_on_gpu\": ", on_gpu, ",\n");
  absl::StrAppend(&s, "  \"decode_requests\": ", r.decode_requests, ",\n");
  absl::StrAppend(&s, "  \"decode_session_steps\": ", r.decode_items, ",\n");
  absl::StrAppend(&s, "  \"working_set_ratio\": ", num(Ratio(t.ws, t.full)), ",\n");
  absl::StrAppend(
      &s, "  \"working_set_ratio_mean_over_rounds\": ", num(Ratio(t.ws_all, t.full_all)), ",\n");
  absl::StrAppend(&s, "  \"store_bytes_ram\": ", opt(r.store_bytes_ram), ",\n");
  absl::StrAppend(&s, "  \"store_bytes_disk\": ", opt(r.store_bytes_disk), ",\n");
  auto memory = [](const v1::ProcessMemory& m) {
    return absl::StrCat("{\"resident_bytes\": ", m.resident_bytes(),
                        ", \"peak_resident_bytes\": ", m.peak_resident_bytes(),
                        ", \"heap_in_use_bytes\": ", m.heap_in_use_bytes(),
                        ", \"heap_free_bytes\": ", m.heap_free_bytes(), "}");
  };
  absl::StrAppend(&s, "  \"worker_memory\": ",
                  t.worker_memory.peak_resident_bytes() > 0 ? memory(t.worker_memory) : "null",
                  ",\n");
  absl::StrAppend(&s, "  \"working_set_peak_sum_bytes\": ", t.ws_peak_sum, ",\n");
  absl::StrAppend(&s, "  \"store_memory\": ",
                  r.store_memory.has_value() ? memory(*r.store_memory) : "null", ",\n");
  absl::StrAppend(&s, "  \"bytes_stored_per_round\": ", num(Ratio(t.stored, t.round_count)), ",\n");
  absl::StrAppend(&s, "  \"segments_per_round\": ", r.segments_per_round, ",\n");
  absl::StrAppend(&s, "  \"bytes_fetched_per_round\": ", num(Ratio(t.fetched, t.round_count)),
                  ",\n");
  absl::StrAppend(&s, "  \"recall_calls\": ", t.recalls, ",\n");
  absl::StrAppend(&s, "  \"recall_rounds_selected\": ", t.selected, ",\n");
  absl::StrAppend(&s, "  \"recall_rounds_candidate\": ", t.candidates, ",\n");
  absl::StrAppend(&s, "  \"recall_reference_hit_rate\": ",
                  t.refs > 0 ? num(Ratio(t.refs_hit, t.refs)) : "null", ",\n");
  absl::StrAppend(&s, "  \"fetch_ms_mean\": ", t.fetches > 0 ? num(t.fetch_ms / t.fetches) : "null",
                  ",\n");
  absl::StrAppend(&s, "  \"fetch_exposed_ms_mean\": ",
                  t.fetches > 0 ? num(t.exposed_ms / t.fetches) : "null", ",\n");
  absl::StrAppend(&s, "  \"decode_ms_per_token\": ", num(Ratio(t.tier_ms, t.decode_tokens)), ",\n");
  absl::StrAppend(&s, "  \"local_decode_ms_per_token\": ", num(Ratio(t.local_ms, t.decode_tokens)),
                  ",\n");
  absl::StrAppend(&s, "  \"attn_rel_err\": ",
                  Synthetic(r) ? num(std::sqrt(Ratio(t.err2, t.ref2))) : "null", ",\n");
  absl::StrAppend(
      &s, "  \"outputs_crc32c\": ", Synthetic(r) ? absl::StrCat(OutputsDigest(r)) : "null", ",\n");
  absl::StrAppend(&s, "  \"top1_agreement\": ", Synthetic(r) ? "null" : num(t.top1), ",\n");
  absl::StrAppend(&s, "  \"kl_nats\": ", Synthetic(r) ? "null" : num(t.kl), ",\n");
  if (r.speculation.empty()) {
    absl::StrAppend(&s, "  \"speculation\": null,\n");
  } else {
    int spec_on_gpu = 0;
    for (const DemoSession& d : r.sessions) spec_on_gpu += d.speculation_on_device ? 1 : 0;
    absl::StrAppend(&s, "  \"speculation\": {\"setting\": ", JsonQuote(r.speculation),
                    ", \"sessions_on_gpu\": ", spec_on_gpu, ", \"layers\": [");
    const std::vector<v1::SpeculationLayer> layers = SumSpeculation(r);
    for (size_t l = 0; l < layers.size(); ++l) {
      const v1::SpeculationLayer& x = layers[l];
      absl::StrAppend(&s, l ? ", " : "", "{\"layer\": ", l, ", \"steps\": ", x.steps(),
                      ", \"past_tokens_mean\": ", num(Ratio(x.past_tokens(), x.steps())),
                      ", \"kept_per_head_mean\": ", num(Ratio(x.kept(), x.steps())),
                      ", \"gathered_per_kv_head_mean\": ",
                      num(Ratio(x.gathered(), x.steps() * std::max(1, r.kv_heads))),
                      ", \"hit_rate\": ", x.sampled() > 0 ? num(x.hit_sum() / x.sampled()) : "null",
                      ", \"mass\": ", x.sampled() > 0 ? num(x.mass_sum() / x.sampled()) : "null",
                      ", \"bytes_speculative\": ", x.bytes_speculative(),
                      ", \"bytes_dense\": ", x.bytes_dense(), "}");
    }
    absl::StrAppend(&s, "]");
    const PoolSum pool = SumPool(r);
    if (pool.cap > 0) {
      absl::StrAppend(&s, ", \"pool\": {\"cap_bytes\": ", pool.cap, ", \"rounds\": ", pool.rounds,
                      ", \"trims\": ", pool.trims, ", \"evicted_tokens\": ", pool.evicted,
                      ", \"reencoded_layers\": ", pool.reencoded,
                      ", \"max_bytes_before\": ", pool.max_before,
                      ", \"max_bytes_after\": ", pool.max_after,
                      ", \"ms_per_trim\": ", num(Ratio(pool.ms, pool.trims)), "}");
    }
    absl::StrAppend(&s, "},\n");
  }
  if (r.conversations.empty()) {
    absl::StrAppend(&s, "  \"replay\": null,\n");
  } else {
    // Over every replayed round: agreement on every assistant token, and
    // accuracy on the scored spans for the tier and the full cache.
    const ReplayTotals rt = SumReplay(r);
    auto frac = [&](int64_t a, int64_t n) { return n > 0 ? num(Ratio(a, n)) : "null"; };
    absl::StrAppend(&s, "  \"replay\": {\"file\": ", JsonQuote(r.conversations),
                    ", \"conversations\": ", r.sessions.size(), ", \"rounds\": ", rt.rounds,
                    ", \"user_tokens\": ", rt.user, ", \"assistant_tokens\": ", rt.assistant,
                    ", \"top1_agreement\": ", frac(rt.agree, rt.assistant),
                    ", \"kl_nats\": ", num(Ratio(rt.kl, rt.assistant)),
                    ", \"scored_tokens\": ", rt.scored,
                    ", \"scored_accuracy_tier\": ", frac(rt.tier, rt.scored),
                    ", \"scored_accuracy_full_cache\": ", frac(rt.local, rt.scored), "},\n");
  }
  absl::StrAppend(&s, "  \"per_session\": [");
  for (size_t i = 0; i < r.sessions.size(); ++i) {
    const DemoSession& d = r.sessions[i];
    const uint64_t full = d.rounds.empty() ? 0 : d.rounds.back().full_cache_bytes;
    const uint64_t ws = d.rounds.empty() ? 0 : d.rounds.back().round_working_set_bytes;
    std::vector<uint64_t> ws_rounds, full_rounds;
    for (const TierRound& tr : d.rounds) {
      ws_rounds.push_back(tr.round_working_set_bytes);
      full_rounds.push_back(tr.full_cache_bytes);
    }
    absl::StrAppend(&s, i ? ",\n" : "\n", "    {\"id\": \"", d.id,
                    "\", \"full_cache_bytes\": ", full, ", \"working_set_bytes\": ", ws,
                    ", \"working_set_per_round\": [", absl::StrJoin(ws_rounds, ", "),
                    "], \"full_cache_per_round\": [", absl::StrJoin(full_rounds, ", "),
                    "], \"recalls\": [");
    bool first = true;
    for (size_t j = 0; j < d.rounds.size(); ++j) {
      const TierRound& tr = d.rounds[j];
      if (!tr.recalled) continue;
      absl::StrAppend(&s, first ? "" : ", ", "{\"round\": ", tr.round, ", \"selected\": [",
                      absl::StrJoin(tr.selected, ", "), "]");
      if (j < d.references.size()) {
        absl::StrAppend(&s, ", \"references\": [", absl::StrJoin(d.references[j], ", "), "]");
      }
      absl::StrAppend(&s, ", \"bytes_fetched\": ", tr.bytes_fetched, "}");
      first = false;
    }
    absl::StrAppend(&s, "]");
    if (!d.replay.empty()) {
      absl::StrAppend(
          &s, ", \"conversation\": ", JsonQuote(d.conversation), ", \"line\": ", JsonQuote(d.where),
          ", \"teacher_cached\": ", d.teacher_cached ? "true" : "false", ", \"replay_rounds\": [");
      for (size_t j = 0; j < d.replay.size(); ++j) {
        const ReplayRoundScore& x = d.replay[j];
        const TierRound* tr = j < d.rounds.size() ? &d.rounds[j] : nullptr;
        absl::StrAppend(
            &s, j ? ", " : "", "{\"round\": ", j, ", \"user_tokens\": ", x.user_tokens,
            ", \"assistant_tokens\": ", x.assistant_tokens, ", \"top1_agree\": ", x.top1_agree,
            ", \"kl_nats\": ", num(Ratio(x.kl_sum, x.assistant_tokens)), ", \"scored\": ", x.scored,
            ", \"tier_correct\": ", x.tier_correct, ", \"full_cache_correct\": ", x.local_correct);
        if (tr != nullptr) {
          absl::StrAppend(&s, ", \"working_set_bytes\": ", tr->round_working_set_bytes,
                          ", \"full_cache_bytes\": ", tr->full_cache_bytes,
                          ", \"bytes_stored\": ", tr->stored_bytes,
                          ", \"bytes_fetched\": ", tr->bytes_fetched, ", \"recalled\": ",
                          tr->recalled ? absl::StrCat("[", absl::StrJoin(tr->selected, ", "), "]")
                                       : std::string("null"));
        }
        absl::StrAppend(&s, "}");
      }
      absl::StrAppend(&s, "]");
      if (!d.answers.empty()) {
        absl::StrAppend(&s, ", \"answers\": [");
        for (size_t j = 0; j < d.answers.size(); ++j) {
          const DemoSession::Answer& a = d.answers[j];
          absl::StrAppend(
              &s, j ? ", " : "", "{\"round\": ", a.round, ", \"question\": ", JsonQuote(a.question),
              ", \"expect\": ", JsonQuote(a.expect), ", \"full_cache\": ", JsonQuote(a.full_cache),
              ", \"full_cache_right\": ", a.full_cache_right ? "true" : "false",
              ", \"kvtier\": ", JsonQuote(a.kvtier),
              ", \"kvtier_right\": ", a.kvtier_right ? "true" : "false", "}");
        }
        absl::StrAppend(&s, "]");
      }
    }
    if (!d.worker.empty()) {
      absl::StrAppend(&s, ", \"worker\": \"", d.worker, "\", \"stores\": [");
      for (size_t j = 0; j < d.stores.size(); ++j) {
        absl::StrAppend(&s, j ? ", " : "", "\"", d.stores[j], "\"");
      }
      absl::StrAppend(&s, "], \"failovers\": [");
      for (size_t j = 0; j < d.failovers.size(); ++j) {
        const Failover& f = d.failovers[j];
        absl::StrAppend(&s, j ? ", " : "", "{\"round\": ", f.round, ", \"from\": \"", f.from,
                        "\", \"to\": \"", f.to, "\", \"recover_ms\": ", num(f.recover_ms), "}");
      }
      absl::StrAppend(&s, "]");
    }
    absl::StrAppend(&s, "}");
  }
  absl::StrAppend(&s, "\n  ]\n}\n");
  return s;
}

}  // namespace kvtier::refengine
