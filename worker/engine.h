// The attention worker engine (ARCHITECTURE.md §5): sessions, their working
// sets, prefill and decode attention layer by layer, round recall at the
// watershed layer, and EndRound (eviction, encoding, PutSegment). No gRPC:
// the store is reached through SegmentStore, and services/worker wraps this
// class in the Worker RPCs.
//
// Working set of a session:
//  - every past round's lower segment (layers [0, L_w]), as the codec left it;
//  - the upper segments (layers (L_w, L)) of the rounds recalled for the
//    current round (and, with release_after_end_round off, of every round);
//  - the current round's K/V in fp32 (its queries too, for eviction scoring).
// With a GPU (EngineOptions::placement) the past rounds' encoded K/V live in
// device memory instead and attention runs there (worker/device_attention.h);
// the open round is mirrored to the device layer by layer.
// Recalls fetched with GetSegments are counted by the store itself; recalls of
// rounds still resident are reported with RecordRecalls at EndRound, so the
// store's per-round counters see every use and drops never-recalled rounds
// first either way.
// Each past round stores per layer and KV head one encoded K and one encoded
// V tensor [1, kept_h, d]: eviction keeps a different number of tokens per
// head (the Ada-KV layout), and attention reads the encoded bytes directly.
#ifndef KVTIER_WORKER_ENGINE_H_
#define KVTIER_WORKER_ENGINE_H_

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/codec.h"
#include "kernels/eviction.h"
#include "worker/recall.h"

namespace kvtier::worker {

struct ModelShape {
  int layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  // Bytes per K/V element in the engine's own cache (fp16: 2): the "full
  // cache" that working-set sizes are compared with.
  int dtype_bytes = 2;
};

struct SessionPolicy {
  // Codec applied at EndRound. Default: raw fp32 (lossless).
  CodecConfig codec = RawFp32Codec();
  // Eviction at EndRound. Default: none.
  evict::Policy eviction = NoEviction();
  // Watershed layer L_w; -1 picks layers / 3 (inside the published
  // 0.18-0.46 range of L_w / L).
  int watershed_layer = -1;
  // Default: adaptive:1 (mean + 1 std).
  RecallStrategy recall;
  bool keep_recent_round = true;
  // Drop recalled and just-stored upper segments from the working set at
  // EndRound (they stay in the store). Default true.
  bool release_after_end_round = true;

  static CodecConfig RawFp32Codec();
  static evict::Policy NoEviction();
};

// Where rounds go: kvtier-store in production (services/worker), any
// implementation in tests of layers above it.
class SegmentStore {
 public:
  virtual ~SegmentStore() = default;
  struct Segment {
    uint32_t round = 0;
    uint32_t segment = 0;  // 0: layers [0, L_w]; 1: (L_w, L).
  };
  virtual absl::Status Put(const std::string& session, const Segment& s, uint32_t layer_begin,
                           uint32_t layer_end, const std::string& payload) = 0;
  // ALREADY_EXISTS (passed through as such) when the segment is stored.
  // Fetches all `segments` in ONE call, in order.
  virtual absl::StatusOr<std::vector<std::string>> Get(const std::string& session,
                                                       const std::vector<Segment>& segments) = 0;
  virtual absl::Status Delete(const std::string& session) = 0;
  // Drops one round (both segments). OK when it was not there.
  virtual absl::Status DropRound(const std::string& session, uint32_t round) = 0;
  // Counts recalls of rounds that were resident (no fetch), in one call.
  virtual absl::Status RecordRecalls(const std::string& session,
                                     const std::vector<uint32_t>& rounds) = 0;
};

struct RecallReport {
  uint32_t round = 0;              // The round that recalled.
  std::vector<uint32_t> selected;  // Past rounds attended above L_w.
  std::vector<double> scores;      // Normalized qAttention per past round.
  uint64_t bytes_fetched = 0;      // Payload bytes of the one GetSegments.
  int fetched_segments = 0;        // 0 when everything was resident.
  double fetch_ms = 0;             // The call's own duration.
  double exposed_ms = 0;           // How long layer L_w + 1 waited for it.
};

struct EndRoundReport {
  uint32_t round = 0;
  uint64_t stored_bytes = 0;       // Both segments' payloads.
  uint64_t full_bytes = 0;         // The round in the model dtype, unevicted.
  uint64_t working_set_bytes = 0;  // Of the session, after release.
  // Of the session just before EndRound (recalled rounds and this round in).
  uint64_t round_working_set_bytes = 0;
  uint64_t full_cache_bytes = 0;  // Of the session, this round included.
  // Rounds this round recalled from the working set without a fetch, whose
  // recall counters went to the store (RecordRecalls) after the puts. A failed
  // call keeps them for the next EndRound: the counters are advisory and
  // EndRound does not fail for them.
  std::vector<uint32_t> recalls_recorded;
};

struct SessionStats {
  uint32_t rounds = 0;             // Completed rounds.
  uint64_t tokens = 0;             // All tokens, the open round's included.
  uint64_t working_set_bytes = 0;  // Now.
  uint64_t peak_working_set_bytes = 0;
  uint64_t full_cache_bytes = 0;  // Every token at every layer, model dtype.
  std::vector<RecallReport> recalls;
  // Resident recalls not yet counted by the store (after a failed report).
  uint64_t pending_recall_counts = 0;
  // The working set is on the GPU: past rounds' encoded K/V in device memory
  // (device_bytes, allocation padding included), attention computed there.
  // Layer L_w's keys also stay on the host for recall scoring.
  bool on_device = false;
  uint64_t device_bytes = 0;
};

struct EngineOptions {
  KernelLevel level = KernelLevel::kBest;
  // Where session working sets live. kAuto: on the GPU when this build has
  // CUDA, a device is present and the codec is one the device path reads (raw,
  // KIVI, KCVT), otherwise in host memory. kHost: always host memory. kDevice:
  // always the GPU; OpenSession fails (FAILED_PRECONDITION) when it cannot.
  enum class Placement { kAuto, kHost, kDevice };
  Placement placement = Placement::kAuto;
};

class Engine {
 public:
  explicit Engine(SegmentStore* store, EngineOptions options = {});
  ~Engine();

  // INVALID_ARGUMENT for a bad shape or policy, ALREADY_EXISTS.
  absl::Status OpenSession(const std::string& id, const ModelShape& shape,
                           const SessionPolicy& policy);

  // One layer of a prefill of n new tokens: q [n, q_heads, d], k and v
  // [n, kv_heads, d] (post-RoPE), out [n, q_heads, d]. Layers go 0..L-1 in
  // order. The first prefill of a round recalls at L_w from its first
  // `question_tokens` queries (all n when 0) and returns the selection from
  // layer L_w; layer L_w + 1 returns it again, completed with the fetched
  // bytes and timings, when a fetch was needed. FAILED_PRECONDITION for a layer
  // out of order; NOT_FOUND for an unknown session; UNAVAILABLE when the
  // recall fetch fails (the round is rolled back to before this prefill).
  absl::StatusOr<std::optional<RecallReport>> PrefillLayer(const std::string& id, int layer,
                                                           int64_t n, int64_t question_tokens,
                                                           const float* q, const float* k,
                                                           const float* v, float* out);

  // One layer of one decode token (n = 1 above, no recall).
  absl::Status DecodeLayer(const std::string& id, int layer, const float* q, const float* k,
                           const float* v, float* out);

  // Eviction, encoding and PutSegment of the open round. UNAVAILABLE when the
  // store fails: the round stays open and EndRound may be retried.
  absl::StatusOr<EndRoundReport> EndRound(const std::string& id);

  absl::Status CloseSession(const std::string& id, bool delete_from_store);

  absl::StatusOr<SessionStats> Stats(const std::string& id) const;
  absl::StatusOr<SessionPolicy> Policy(const std::string& id) const;
  absl::StatusOr<ModelShape> Shape(const std::string& id) const;
  std::vector<std::string> Sessions() const;
  // Working-set bytes over all sessions (no per-session copies).
  uint64_t TotalWorkingSetBytes() const;

 private:
  class Session;
  absl::StatusOr<std::shared_ptr<Session>> Find(const std::string& id) const;

  SegmentStore* store_;
  EngineOptions options_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> sessions_;
};

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_ENGINE_H_
