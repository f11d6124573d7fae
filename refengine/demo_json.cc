// The demo's JSON report (RenderJson, refengine/demo.h): every figure of the
// text report and each session's rounds, for scripts.
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "refengine/demo.h"
#include "refengine/demo_totals.h"
#include "refengine/replay.h"

namespace kvtier::refengine {

using report::PoolSum;
using report::Ratio;
using report::ReplayTotals;
using report::Sum;
using report::SumPool;
using report::SumReplay;
using report::SumSpeculation;
using report::Synthetic;
using report::Totals;

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
