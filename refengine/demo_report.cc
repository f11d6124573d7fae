// The demo's text report (RenderText): what a person reads, from a
// DemoReport (demo_json.cc writes the JSON one).
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
#include "refengine/demo_totals.h"

namespace kvtier::refengine {
namespace {

using report::PoolSum;
using report::Ratio;
using report::ReplayTotals;
using report::Sum;
using report::SumPool;
using report::SumReplay;
using report::SumSpeculation;
using report::Synthetic;
using report::Totals;

std::string Mib(uint64_t b) { return absl::StrFormat("%.2f MiB", b / 1048576.0); }
std::string Kib(double b) { return absl::StrFormat("%.1f KiB", b / 1024.0); }

// Per-round lines of the text report for this many conversations (the JSON
// report has every one).
constexpr size_t kReplayRoundsShown = 8;

// A share as text: "0.957", or "-" of nothing.
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
  if (t.tier_ms < t.local_ms) {
    // kvtier faster than its own reference reads as a miracle: say why.
    s += "  (the full cache is the reference: fp32, every token, each prefill attended token "
         "by token; the worker engine attends a step's tokens in one call over its working "
         "set, in the model's dtype or the codec's)\n";
  }
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

}  // namespace kvtier::refengine
