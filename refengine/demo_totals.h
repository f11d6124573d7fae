// What the demo's reports (demo_report.cc: text, demo_json.cc: JSON) sum
// from a DemoReport: totals over sessions and rounds, a replay's scores,
// speculation per layer, the host pool's trims. Not part of the public
// interface.
#ifndef KVTIER_REFENGINE_DEMO_TOTALS_H_
#define KVTIER_REFENGINE_DEMO_TOTALS_H_

#include <cstdint>
#include <vector>

#include "refengine/demo.h"

namespace kvtier::refengine::report {

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
Totals Sum(const DemoReport& r);

// The synthetic chat (no model).
bool Synthetic(const DemoReport& r);

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
ReplayTotals SumReplay(const DemoReport& r);

// a / b, 0 when b is 0.
double Ratio(double a, double b);

// Speculation's figures per layer, summed over every session and round.
std::vector<v1::SpeculationLayer> SumSpeculation(const DemoReport& r);

// The host pool's trims, over every session and round.
struct PoolSum {
  uint64_t cap = 0, rounds = 0, trims = 0, evicted = 0, reencoded = 0;
  uint64_t max_before = 0, max_after = 0;
  double ms = 0;  // Summed over the trims.
};
PoolSum SumPool(const DemoReport& r);

}  // namespace kvtier::refengine::report

#endif  // KVTIER_REFENGINE_DEMO_TOTALS_H_
