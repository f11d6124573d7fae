#include "refengine/demo_totals.h"

#include <algorithm>

namespace kvtier::refengine::report {

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

ReplayTotals SumReplay(const DemoReport& r) {
  ReplayTotals t;
  for (const DemoSession& d : r.sessions) {
    for (const ReplayRoundScore& x : d.replay) t.Add(x);
  }
  return t;
}

double Ratio(double a, double b) { return b > 0 ? a / b : 0; }

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

}  // namespace kvtier::refengine::report
