// The attention worker engine (ARCHITECTURE.md §5): sessions, their working
// sets, prefill and decode attention layer by layer, round recall at the
// watershed layer, and EndRound (eviction, encoding, PutSegment). No gRPC:
// the store is reached through SegmentStore (worker/segment_store.h), and
// services/worker wraps this class in the Worker RPCs.
//
// Working set of a session:
//  - every past round's lower segment (layers [0, L_w]), as the codec left it;
//  - the upper segments (layers (L_w, L)) of the rounds recalled for the
//    current round (and, with release_after_end_round off, of every round);
//  - the current round's K/V in fp32, head-major (its queries too, for
//    eviction scoring);
//  - with speculation, the partial skewed keys of the rounds it scored
//    (r floats per token and KV head, beside each round's layer).
// With a GPU (EngineOptions::placement) the past rounds' encoded K/V live in
// device memory instead and attention runs there (worker/device/attention.h);
// the open round is mirrored to the device layer by layer.
// Recalls fetched with GetSegments are counted by the store itself; recalls of
// rounds still resident are reported with RecordRecalls at EndRound, so the
// store's per-round counters see every use and drops never-recalled rounds
// first either way.
// Each past round stores per layer and KV head one encoded K and one encoded
// V tensor [1, kept_h, d]: eviction keeps a different number of tokens per
// head (the Ada-KV layout), and attention reads the encoded bytes directly.
//
// The files: engine.cc (sessions, steps, stats), session.{h,cc} (one
// session's state and attention), recall_fetch.cc (recall at L_w and the
// fetch), round_writer.cc (EndRound: plan, send, commit). A session's
// hand-off to another worker is SessionTransfer's (transfer.h), the skews
// sessions speculate with are a SkewRegistry's (skew_registry.h), and the
// GPU working set is in device/.
#ifndef KVTIER_WORKER_ENGINE_H_
#define KVTIER_WORKER_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/call_options.h"
#include "base/clock.h"
#include "base/executor.h"
#include "base/memory.h"
#include "encoded/encoded_tensor.h"
#include "kernels/codec.h"
#include "kernels/eviction.h"
#include "kernels/recall.h"
#include "kernels/speculation.h"
#include "worker/device/link_pool.h"
#include "worker/device/transfer.h"
#include "worker/handoff_cache.h"
#include "worker/rows.h"
#include "worker/segment_store.h"
#include "worker/session_key.h"
#include "worker/skew_registry.h"

namespace kvtier::worker {

class DeviceLayer;  // worker/device/attention.h

struct ModelShape {
  int layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  // The model's K/V dtype (fp16, bf16 or fp32): the open round is held in
  // it, and the "full cache" that working-set sizes are compared with is
  // counted in it. Default: fp16.
  DType dtype = DType::kFp16;
  // Per layer, the sliding window (a token attends to itself and the
  // window - 1 tokens before it), 0 for a global layer. Empty: all global.
  std::vector<int> window = {};
  // The model's identity (ModelSpec.model_digest), recorded with every
  // stored round; 0: unknown.
  uint64_t model_digest = 0;
  // Bytes per K/V element; 0 for a dtype that is not one of the three.
  int dtype_bytes() const { return DTypeSize(dtype); }
  int layer_window(int l) const { return window.empty() ? 0 : window[l]; }
  bool sliding() const {
    for (int w : window) {
      if (w > 0) return true;
    }
    return false;
  }
  bool operator==(const ModelShape&) const = default;
};

struct SessionPolicy {
  // Codec applied at EndRound. Default: raw fp32 (lossless).
  CodecConfig codec = RawFp32Codec();
  // Eviction at EndRound. Default: none.
  evict::Policy eviction = NoEviction();
  // Watershed layer L_w. Default: -1, which picks layers / 3 (inside the
  // published 0.18-0.46 range of L_w / L).
  int watershed_layer = -1;
  // Which past rounds layers above L_w attend. Default: adaptive:1 (mean +
  // 1 std of the normalized qAttention).
  RecallStrategy recall;
  // The most recent past round is attended above L_w whatever its score.
  // Default: true.
  bool keep_recent_round = true;
  // Drop recalled and just-stored upper segments from the working set at
  // EndRound (they stay in the store, and recall brings them back).
  // Default: true. Off, every round stays resident and the working set
  // grows like the full cache.
  bool release_after_end_round = true;
  // Speculative token selection (InfiniGen, docs/speculation.md) at decode
  // steps that carry the next layer's approximate query: layer l + 1 attends
  // only the past rounds' tokens speculated from it, plus the open round in
  // full. `skew` names a skew uploaded with SkewRegistry::Put
  // (Engine::skews()); empty: off (the default). alpha > 0 (default 4,
  // softmax-logit units); budget caps the tokens per head (0: none). Host
  // working sets only.
  //   pool_bytes caps the host pool: the past rounds' resident K/V at the
  //   layers speculation serves (1 to L - 1), in encoded bytes. At EndRound
  //   a pool above it loses tokens, fewest fetches (gathers) first among
  //   each layer and KV head's older half, until it fits; the layers that
  //   lost tokens are re-encoded with the session's codec. 0: no cap (the
  //   default).
  //   pool_low_bytes: where such a trim stops (at most pool_bytes; 0: the
  //   cap itself). Trimming below the cap leaves room for the next rounds,
  //   so trims come less often.
  struct Speculation {
    std::string skew;
    float alpha = 4.0f;
    int budget = 0;
    int64_t pool_bytes = 0;
    int64_t pool_low_bytes = 0;
  };
  Speculation speculation;

  static CodecConfig RawFp32Codec();
  static evict::Policy NoEviction();
};

struct RecallReport {
  uint32_t round = 0;              // The round that recalled.
  std::vector<uint32_t> selected;  // Past rounds attended above L_w.
  // Rounds recall picked that the store had dropped (under pressure): they
  // are attended up to L_w only, and never picked again.
  std::vector<uint32_t> gone;
  std::vector<double> scores;  // Normalized qAttention per past round.
  uint64_t bytes_fetched = 0;  // Payload bytes of the one GetSegments.
  int fetched_segments = 0;    // 0 when everything was resident.
  // From the fetch's start at layer L_w (its wait for a fetch thread
  // included) to its end.
  double fetch_ms = 0;
  double exposed_ms = 0;  // How long layer L_w + 1 waited for it (<= fetch_ms).
};

// What speculation did at one layer during a round (decode steps that
// carried an approximate query for it).
struct SpeculationLayerStats {
  uint64_t steps = 0;        // Decode steps that speculated this layer.
  uint64_t past_tokens = 0;  // Past-round tokens visible, summed over steps.
  uint64_t kept = 0;         // Tokens per query head (n), summed over steps.
  uint64_t gathered = 0;     // Tokens gathered (the union per KV head, summed over KV heads).
  // Bytes read: the partial keys scored plus the gathered tokens' encoded
  // K/V; and what dense attention over the same rounds reads (their
  // encoded K/V).
  uint64_t bytes_speculative = 0, bytes_dense = 0;
  // Hit rate and mass (spec::Score), on every 16th step.
  uint64_t sampled = 0;
  double hit_sum = 0, mass_sum = 0;
};

// What the host pool (SessionPolicy::Speculation::pool_bytes) did at an
// EndRound.
struct PoolTrim {
  uint64_t cap_bytes = 0;  // 0: no cap.
  // The pool (resident past rounds at layers 1 to L - 1, encoded bytes)
  // before and after the trim, this round included.
  uint64_t bytes_before = 0, bytes_after = 0;
  uint64_t evicted_tokens = 0;    // Summed over layers and KV heads.
  uint64_t reencoded_layers = 0;  // Round layers re-encoded without them.
  double ms = 0;                  // The trim's time, under the session's lock.
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
  // Per layer, when the round's decode steps speculated; empty otherwise.
  std::vector<SpeculationLayerStats> speculation;
  // The host pool's trim (a speculating session with a pool cap).
  PoolTrim pool;
  // The whole process's memory once the round is written.
  ProcessMemory process_memory;
};

struct SessionStats {
  // The policy the session runs under (watershed_layer resolved).
  SessionPolicy policy;
  uint32_t rounds = 0;             // Completed rounds.
  uint64_t tokens = 0;             // All tokens, the open round's included.
  uint64_t working_set_bytes = 0;  // Now.
  uint64_t peak_working_set_bytes = 0;
  uint64_t full_cache_bytes = 0;  // Every token at every layer, model dtype.
  // Host bytes the open round holds now (capacity): K/V in the model's dtype
  // plus the queries the round's eviction reads (fp32; none without
  // eviction, the last w for SnapKV-family methods, all for H2O). The
  // working set counts the open round at the model's dtype only.
  uint64_t open_round_bytes = 0;
  // K/V values converted on their way into the open round: 0 when the
  // engine's callers send K/V in the model's dtype (they are copied).
  uint64_t converted_kv_values = 0;
  std::vector<RecallReport> recalls;
  // Resident recalls not yet counted by the store (after a failed report).
  uint64_t pending_recall_counts = 0;
  // The working set is on the GPU: past rounds' encoded K/V in device memory
  // (device_bytes, allocation padding included), attention computed there.
  // Layer L_w's keys also stay on the host for recall scoring.
  bool on_device = false;
  // Speculation runs on the GPU (DeviceSpeculator): the past rounds stay in
  // the host pool, and the device holds the partial keys, the open round's
  // mirror and the speculated tokens' K/V (counted in device_bytes).
  bool speculation_on_device = false;
  uint64_t device_bytes = 0;
  // Where the decode layers that attended over speculated tokens spent their
  // time: host wall clock, summed over the session. On the GPU path the
  // select and attend parts include waiting for the device.
  struct SpeculationTime {
    uint64_t steps = 0;     // Layer steps that attended over gathered tokens.
    absl::Duration select;  // Partial keys, scores and top n (GPU: launch and wait).
    absl::Duration gather;  // The picks' rows decoded from the host pool.
    absl::Duration upload;  // GPU: the rows into pinned memory and up.
    absl::Duration attend;  // Attention over them and the open round.
    absl::Duration sample;  // Hit-rate samples (a dense pass every 16th step).
  };
  SpeculationTime speculation_time;
};

// A session as a transfer carries it from one worker to another (the
// prefill -> decode hand-off, docs/transfer.md): everything but its K/V,
// which travels layer by layer as LayerImages. ExportSession fills the part
// known when a step starts, ExportTail the open round's state once the step
// is done.
struct SessionImage {
  ModelShape shape;
  SessionPolicy policy;          // watershed_layer resolved.
  evict::Policy round_eviction;  // What the open round's EndRound applies.
  struct Round {
    uint32_t round = 0;
    int64_t tokens = 0;
    uint64_t stored_bytes = 0;
  };
  std::vector<Round> past;
  // The session's incarnation (HandoffCache): the receiver may hold rounds
  // of it already, which then do not travel.
  uint64_t incarnation = 0;
  // Its working set is on this worker's GPU (export side only).
  bool on_device = false;
  // The tail.
  int64_t open_tokens = 0;           // Committed tokens of the open round; 0: idle.
  bool recall_ready = false;         // The open round's recall is done.
  std::vector<uint32_t> selected;    // Past rounds attended above L_w.
  std::vector<uint32_t> upper_gone;  // Past rounds the store dropped.
  std::vector<uint32_t> round_resident, unreported_recalls;
  uint32_t rounds = 0;  // SessionStats: completed rounds, tokens, peak, full cache.
  uint64_t tokens = 0;
  uint64_t peak_working_set_bytes = 0;
  uint64_t full_cache_bytes = 0;  // Of the past rounds (the open round is added).
};

// One layer of a session's K/V as a transfer carries it.
// Engine::BeginImport's result (worker/session.h).
struct PreparedImport;

struct LayerImage {
  int layer = 0;
  // The past rounds resident at this layer, in the session's order, and their
  // tensors exactly as stored: a serialized SegmentPayload of 2 * kv_heads
  // EncodedTensors per round (K, V per head), nothing decoded or re-encoded.
  std::vector<uint32_t> rounds;
  // Of `rounds`, those the receiver already holds (its HandoffCache, same
  // incarnation): they are not in the payload, which holds the others in
  // order. Set by the sender from what the receiver answered, read by
  // ImportSession.
  std::vector<uint32_t> reused;
  // Export: where each round's pieces start in past_pieces (one entry per
  // round, then past_pieces.size()), so a sender can leave rounds out.
  std::vector<size_t> round_first_piece;
  // Export: rounds whose layer the host pool trimmed here (RoundLayer::
  // trimmed): what a receiver holds of them may have more tokens, so they
  // are never left out.
  std::vector<uint32_t> trimmed;
  // Export (ExportLayer) gives the payload as pieces, in order, without
  // copying a tensor: each tensor's protobuf framing (small, in a buffer of
  // the export's own) and the tensor's bytes where the working set holds
  // them, each piece with the buffer that keeps it alive. So pieces
  // alternate: framing at even positions, one whole tensor at odd ones. Import
  // (ImportSession) takes either the pieces or `past`, the payload in one
  // buffer (what a receiver assembles from the wire).
  struct Piece {
    std::shared_ptr<const std::string> owner;
    std::string_view bytes;
    // A tensor's (odd positions): what Crc32cOutsideBufferData covers of
    // it, where the working set kept it (RoundLayer::outside).
    std::optional<OutsideCrc> outside;
  };
  std::vector<Piece> past_pieces;
  std::shared_ptr<const std::string> past;
  // Of `rounds`, those whose layer lives in device memory only, when the
  // export was asked for them as they are (ExportLayer's device_rounds):
  // their range in past_pieces is empty until ResolveDevice reads them back.
  // On import, the layers a receiver copied device to device (CUDA IPC),
  // with each head's token count and the tensors' serialized size.
  struct DeviceRound {
    uint32_t round = 0;
    std::shared_ptr<DeviceLayer> layer;
    std::vector<int64_t> lens;  // Import only.
    int64_t bytes = 0;
  };
  std::vector<DeviceRound> device_rounds;
  // The open round's rows at this layer in the model's dtype: K
  // [kv_heads][open_rows][d], then V, then the queries eviction will read,
  // fp32 [q_heads][q_rows][d] (rows [q_first, q_first + q_rows) of the round).
  int64_t open_rows = 0, q_first = 0, q_rows = 0;
  std::string open;
  // Bytes of the past rounds' tensors if they were raw in the model's dtype
  // (what a transfer of an engine's own blocks would send).
  uint64_t past_raw_bytes = 0;
  uint64_t past_size() const;
  // The past rounds' payload in one buffer (a copy of the pieces, or `past`).
  std::string PastBytes() const;
  uint64_t bytes() const { return past_size() + open.size(); }
  // Leaves out of the export's pieces the rounds that `held` (the
  // receiver's HeldRounds) has at this layer, naming them in `reused`.
  // Returns the tensors' bytes left out (their framing not counted, as in
  // RoundLayer::bytes).
  uint64_t LeaveOut(const std::vector<HandoffCache::Held>& held);
  // Reads the device rounds back (DeviceLayer::Serialized) into the pieces,
  // where their rounds' pieces belong: the layer then travels over gRPC
  // alone. The layers' statuses (INTERNAL for one that cannot be read back).
  absl::Status ResolveDevice();
  // Receiver: checks `past` (the rounds that travelled: neither reused nor
  // device rounds), each tensor against its own crc32c, and splits it into
  // round layers of kv_heads heads of head_dim, which ImportSession then
  // takes as they are instead of parsing `past` again. DATA_LOSS for a
  // tensor that does not match its crc32c or a payload that is not one round
  // layer per travelled round. With `outside_crc`, extends it over what
  // Crc32cOutsidePayloadBufferData covers, in the same pass.
  absl::Status CheckPast(int kv_heads, int head_dim, uint32_t* outside_crc = nullptr);
  // The rounds whose bytes are in `past`: neither reused nor device rounds.
  int travelled_rounds() const {
    return static_cast<int>(rounds.size() - reused.size() - device_rounds.size());
  }
  std::shared_ptr<std::vector<std::unique_ptr<RoundLayer>>> parsed;  // Set by CheckPast.
};

struct EngineOptions {
  // Kernels for host attention and the codecs. Default: kBest (AVX2 when the
  // CPU has it).
  KernelLevel level = KernelLevel::kBest;
  // Where session working sets live. kAuto: on the GPU when this build has
  // CUDA, a device is present and the codec is one the device path reads (raw,
  // KIVI, KCVT), otherwise in host memory. kHost: always host memory. kDevice:
  // always the GPU; OpenSession fails (FAILED_PRECONDITION) when it cannot.
  // Default: kAuto.
  enum class Placement { kAuto, kHost, kDevice };
  Placement placement = Placement::kAuto;
  // The device paths of hand-offs (docs/transfer.md): a session on the GPU
  // offers them to its receiver, and a receiver that places sessions on its
  // GPU takes CUDA IPC from a sender on the same GPU in another process, or
  // NCCL from one on another GPU. false: every hand-off goes over gRPC.
  // Default: true.
  bool device_transfer = true;
  // CUDA IPC hand-offs from this worker: at most this many bytes of a
  // hand-off's round layers are packed into a few allocations (IpcPack), so
  // that the receiver opens one handle for many; they are device memory held
  // beside the session's own until the receiver answers. 0: every round
  // layer is named as it is (a handle each). Default: 256 MiB (kvtier-worker
  // --ipc_pack_mib).
  uint64_t ipc_pack_bytes = uint64_t{256} << 20;
  // Runs the recall fetches (one GetSegments each), so that they overlap the
  // layers between L_w and L_w + 1. Not owned; it must outlive the engine,
  // and must not be the pool that runs the engine's callers (a caller at
  // L_w + 1 waits for a fetch). Default: null, the engine starts its own
  // pool of `fetch_threads` threads.
  Executor* fetch_executor = nullptr;
  // Threads of the engine's own fetch pool. Default: 4.
  int fetch_threads = 4;
  // Deadline of the engine's store calls when the caller's CallOptions carry
  // none. Default: 10 s.
  absl::Duration store_deadline = absl::Seconds(10);
  // Sessions held at once; OpenSession past it is RESOURCE_EXHAUSTED.
  // 0: no limit. Default: 1024.
  int max_sessions = 1024;
  // Working-set bytes over all sessions (SessionStats::working_set_bytes
  // summed: encoded past rounds plus open rounds at the model's dtype). A
  // step that would take the total past it is refused, RESOURCE_EXHAUSTED,
  // before anything is appended; it is checked when a step begins, so a
  // recall that lands during a step may exceed it by the recalled bytes.
  // 0: no limit. Default: 0.
  uint64_t max_working_set_bytes = 0;
  // Limits per tenant (SessionKey::tenant), on top of the two above: the
  // sessions it may hold and its sessions' working-set bytes (checked as
  // max_working_set_bytes is). 0 in a field: no limit; a tenant not listed
  // has none. Default: empty.
  struct TenantLimit {
    int max_sessions = 0;
    uint64_t max_working_set_bytes = 0;
  };
  std::map<std::string, TenantLimit> tenant_limits;
  // The limits of every tenant that tenant_limits does not list (a tenant a
  // node token acts for, say). Default: none (kvtier-worker sets its
  // --tenant_max_sessions and --tenant_max_working_set_mb here when more
  // than one tenant may write).
  TenantLimit default_tenant_limit;
  // The hand-off cache (docs/transfer.md#incremental-hand-off): a session
  // that leaves by hand-off leaves its past rounds here, so that when it
  // comes back only the rounds it gained elsewhere travel. Not part of the
  // working set; whole sessions are dropped past the cap, the least
  // recently used first. 0: off. Default: 512 MiB.
  uint64_t handoff_cache_bytes = uint64_t{512} << 20;
  // The skews sessions speculate with (not owned; it must outlive the
  // engine): a worker's service uploads into it (Worker.PutSkew, --skew_dir).
  // Null: the engine keeps a registry of its own (Engine::skews()).
  SkewRegistry* skews = nullptr;
  // The time sessions' idle ages (Sessions()) and the hand-off cache's
  // leases are read from (not owned; it must outlive the engine). Timings in
  // the stats read the steady clock. Default: the real clock.
  Clock* clock = Clock::Real();
};

// Thread-safe: any method may be called from any thread. Calls on one
// session are serialized by the session's lock; the engine never holds that
// lock across a store call or a wait (EndRound plans under it, sends without
// it, commits under it again; layer L_w + 1 waits for the recall fetch
// without it). Steps of one session must still come in order (a session's
// layers are a sequence); steps of different sessions run in parallel.
//
// Lock order: Engine::mu_ before Session::mu; neither is held across a call
// into SegmentStore.
class Engine {
 public:
  explicit Engine(SegmentStore* store, EngineOptions options = {});
  // Waits for fetches still in flight (they use the store).
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // OK; INVALID_ARGUMENT for a bad shape or policy; ALREADY_EXISTS;
  // RESOURCE_EXHAUSTED at max_sessions; FAILED_PRECONDITION when placement
  // is kDevice and there is no device.
  absl::Status OpenSession(const SessionKey& id, const ModelShape& shape,
                           const SessionPolicy& policy);

  // Opens `id` as OpenSession does, on a worker that never held it, from
  // its rounds in the store: every stored round's lower segment (layers
  // [0, L_w]) comes back in one Get and becomes resident; upper segments
  // stay in the store until recall selects them. Returns the next round's
  // number. OK; the statuses of OpenSession; NOT_FOUND when the store has no
  // such session; FAILED_PRECONDITION when a stored round's segments do not
  // fit this policy's L_w; DATA_LOSS for malformed payloads; UNAVAILABLE or
  // DEADLINE_EXCEEDED from the store (nothing is opened then). The resumed
  // rounds' full-cache size is counted from their stored token counts (after
  // eviction, if the policy evicted). `at_round`: rounds stored from it on
  // were never acknowledged to the caller; they are dropped from the store
  // and the session resumes at `at_round` (INVALID_ARGUMENT when the store
  // lacks an earlier round).
  absl::StatusOr<uint32_t> ResumeSession(const SessionKey& id, const ModelShape& shape,
                                         const SessionPolicy& policy, const CallOptions& call = {},
                                         std::optional<uint32_t> at_round = std::nullopt);

  // One layer of a prefill of n new tokens: q [n, q_heads, d], k and v
  // [n, kv_heads, d] (post-RoPE), out [n, q_heads, d]. Layers go 0..L-1 in
  // order. q, k and v must be finite, and k and v within fp16 range when the
  // session's codec stores fp16 or quantizes (INVALID_ARGUMENT naming the
  // layer and the element; nothing is appended). The first prefill of a
  // round recalls at L_w from its first
  // `question_tokens` queries (all n when 0) and returns the selection from
  // layer L_w; layer L_w + 1 returns it again, completed with the fetched
  // bytes and timings, when a fetch was needed. Outcomes: OK and *out set;
  // NOT_FOUND for an unknown session; INVALID_ARGUMENT for a layer outside
  // the model, n < 1 or a bad value; RESOURCE_EXHAUSTED at layer 0 when the
  // step would exceed max_working_set_bytes; FAILED_PRECONDITION for a layer
  // out of order or while
  // EndRound runs; when the recall fetch fails, the store's status
  // (UNAVAILABLE when it could not be reached, DEADLINE_EXCEEDED by
  // `call.deadline`, DATA_LOSS for a corrupt stored segment, ...), and
  // DATA_LOSS when it brings back malformed bytes: in these the step is
  // rolled back to before this prefill, so the engine may send the whole
  // step again.
  //
  // q [n, Hq, d], k and v [n, Hkv, d] are token-major rows (worker/rows.h)
  // of fp32, fp16 or bf16: K/V in the model's dtype go into the open round
  // as they are; q is read in fp32 (widened here when it is not). out
  // [n, Hq, d] is fp32.
  absl::StatusOr<std::optional<RecallReport>> PrefillLayer(const SessionKey& id, int layer,
                                                           int64_t n, int64_t question_tokens,
                                                           const Rows& q, const Rows& k,
                                                           const Rows& v, float* out,
                                                           const CallOptions& call = {});

  // One layer of one decode token (n = 1 above, no recall). OK; NOT_FOUND;
  // INVALID_ARGUMENT; RESOURCE_EXHAUSTED as above; FAILED_PRECONDITION
  // before the round's first prefill,
  // for a layer out of order, or while EndRound runs.
  // q_next (optional, [q_heads, d]): layer + 1's approximate post-RoPE
  // query, for speculation (SessionPolicy::speculation); ignored when the
  // session does not speculate, at the last layer, or when layer + 1 slides
  // (a sliding layer attends over its window, dense). It must be finite
  // (INVALID_ARGUMENT) where it is used.
  absl::Status DecodeLayer(const SessionKey& id, int layer, const Rows& q, const Rows& k,
                           const Rows& v, float* out, const Rows& q_next = {});

  // The skews that SessionPolicy::speculation.skew names (the options' or
  // the engine's own).
  SkewRegistry& skews() const { return *skews_; }

  // Abandons the step in flight (layers sent, not all of them): the open
  // round goes back to where it was before the step; a round whose first
  // prefill is abandoned is not open any more. What a stream that broke
  // mid-step calls. OK (also when no step is in flight); NOT_FOUND.
  absl::Status AbortStep(const SessionKey& id);

  // Eviction, encoding and PutSegment of the open round. OK and the report;
  // NOT_FOUND; FAILED_PRECONDITION without an open round or in the middle of
  // a step; ABORTED while another EndRound of the session runs (retry);
  // UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED (the tenant's store
  // quota) or PERMISSION_DENIED when the store refuses: the round stays
  // open, no half of it stays in the store, and EndRound may be retried.
  absl::StatusOr<EndRoundReport> EndRound(const SessionKey& id, const CallOptions& call = {});

  // Forgets the session; with `delete_from_store` its stored rounds too
  // (then the store's status, UNAVAILABLE or DEADLINE_EXCEEDED, is returned,
  // and the session is gone from the worker either way). OK; NOT_FOUND.
  absl::Status CloseSession(const SessionKey& id, bool delete_from_store,
                            const CallOptions& call = {});

  // A session's hand-off to and from other workers is SessionTransfer's
  // (worker/transfer.h), which works on the engine's sessions and budgets.
  // Working-set bytes held on a tenant's behalf outside any session: a
  // session arriving by hand-off holds each layer's bytes from the moment
  // the layer is announced until the session is imported or the stream
  // ends. They count in totals().working_set_bytes and in the tenant's share, so
  // that arrivals in flight cannot together pass the worker's or the
  // tenant's budget. Thread-compatible; destroying it gives the bytes back.
  // Must not outlive the engine.
  class IncomingHold {
   public:
    ~IncomingHold();
    IncomingHold(const IncomingHold&) = delete;
    IncomingHold& operator=(const IncomingHold&) = delete;
    // Takes `bytes` more; RESOURCE_EXHAUSTED (nothing taken) when that
    // would pass max_working_set_bytes or the tenant's limit.
    absl::Status Grow(uint64_t bytes);
    uint64_t bytes() const { return bytes_; }

   private:
    friend class Engine;
    friend class SessionTransfer;
    IncomingHold(Engine* engine, std::string tenant, void* use)
        : engine_(engine), tenant_(std::move(tenant)), use_(use) {}
    Engine* const engine_;
    const std::string tenant_;
    void* const use_;  // The tenant's TenantUse.
    uint64_t bytes_ = 0;
  };

  // NOT_FOUND for an unknown session.
  absl::StatusOr<SessionStats> Stats(const SessionKey& id) const;
  absl::StatusOr<ModelShape> Shape(const SessionKey& id) const;
  // Every session, with the milliseconds since its last step or EndRound.
  struct SessionEntry {
    SessionKey key;
    int64_t idle_ms = 0;
  };
  std::vector<SessionEntry> Sessions() const;

  // Replaces what EndRound applies to the session's next rounds (codec,
  // eviction) and how it recalls; the watershed layer stays (stored rounds
  // are split at it). Rounds already stored keep their encoding. OK;
  // NOT_FOUND; INVALID_ARGUMENT as OpenSession; FAILED_PRECONDITION when the
  // session's working set is on the GPU and the device cannot read the codec.
  absl::Status UpdatePolicy(const SessionKey& id, SessionPolicy policy);
  // The sessions open now, and their working-set bytes as last accounted
  // (each session accounts at the end of every step, EndRound, recall and
  // rollback; arrivals in flight count too).
  struct Totals {
    int sessions = 0;
    uint64_t working_set_bytes = 0;
  };
  Totals totals() const;

 private:
  friend class SessionTransfer;
  class Session;
  struct Fetch;
  absl::StatusOr<std::shared_ptr<Session>> Find(const SessionKey& id) const;
  // OpenSession's two halves: a checked, empty session; then its entry in
  // sessions_ (limits checked there).
  absl::StatusOr<std::shared_ptr<Session>> CreateSession(const SessionKey& id,
                                                         const ModelShape& shape,
                                                         const SessionPolicy& policy);
  // `allow_device` false keeps the session in host memory whatever the
  // placement (an imported open round has no device mirror).
  // `prepared`: the device working set to use (BeginImport's) when the
  // session goes on the GPU, instead of a new one.
  absl::StatusOr<std::shared_ptr<Session>> CreateSession(
      const SessionKey& id, const ModelShape& shape, const SessionPolicy& policy, bool allow_device,
      std::unique_ptr<DeviceSession> prepared = nullptr);
  absl::Status Insert(const SessionKey& id, std::shared_ptr<Session> s);
  // ALREADY_EXISTS, or RESOURCE_EXHAUSTED at the session limits (REQUIRES mu_).
  absl::Status CheckRoomLocked(const SessionKey& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a session under `policy` tries for a device working set here:
  // not with --placement=host, nor when it speculates (its past rounds stay
  // in the host pool). Then DeviceReads says whether this worker's device
  // can hold it, or why not.
  bool TriesDevice(const SessionPolicy& policy) const;
  static absl::Status DeviceReads(const SessionPolicy& policy);
  // Takes the session out of the engine and its totals.
  absl::StatusOr<std::shared_ptr<Session>> Remove(const SessionKey& id);
  // Scores the past rounds at L_w and starts the one fetch (recall_fetch.cc).
  // REQUIRES: s.mu held (both; checked with AssertHeld).
  // q and k: the round's first n tokens at L_w, token-major as they arrived.
  RecallReport StartRecall(Session& s, int64_t n, int64_t question_tokens, const float* q,
                           const float* k, const CallOptions& call);
  // At layer L_w + 1, after waiting for `f` without the session lock:
  // installs the fetched upper segments, or rolls the step back when the
  // fetch failed or had not `arrived` by the deadline (recall_fetch.cc).
  absl::StatusOr<RecallReport> InstallFetch(Session& s, const std::shared_ptr<Fetch>& f,
                                            bool arrived, double exposed_ms);
  absl::Time StoreDeadline(const CallOptions& call) const {
    return call.DeadlineOr(options_.store_deadline);
  }
  // PrefillLayer under the session lock (REQUIRES s.mu), after any wait.
  absl::StatusOr<std::optional<RecallReport>> PrefillLocked(Session* s, int layer, int64_t n,
                                                            int64_t question_tokens, const Rows& q,
                                                            const Rows& k, const Rows& v,
                                                            float* out, const CallOptions& call,
                                                            const std::shared_ptr<Fetch>& fetch,
                                                            bool arrived, double exposed_ms);
  // What one tenant holds. Entries are never erased (pointers stay valid);
  // there is one per tenant that ever opened a session.
  struct TenantUse {
    std::atomic<int64_t> bytes{0};
    int sessions = 0;                                   // Guarded by mu_.
    const EngineOptions::TenantLimit* limit = nullptr;  // Null: none.
  };
  // The limits of `tenant`: its tenant_limits entry, else
  // default_tenant_limit; null when neither sets any.
  const EngineOptions::TenantLimit* LimitFor(const std::string& tenant) const;
  // The tenant's entry, made on first use (REQUIRES mu_).
  TenantUse& UseOf(const std::string& tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Brings the engine's and the tenant's totals up to date with `s`
  // (REQUIRES s.mu).
  void Account(Session& s);
  // RESOURCE_EXHAUSTED when `bytes` more would pass max_working_set_bytes or
  // the session's tenant's limit.
  absl::Status CheckBudget(const Session& s, uint64_t bytes) const;
  // The same for a tenant holding `tenant_bytes` under `limit` (null: none).
  absl::Status CheckBudgetFor(const std::string& tenant, const EngineOptions::TenantLimit* limit,
                              int64_t tenant_bytes, uint64_t bytes) const;

  // Gives a speculating session (its skew resolved) a DeviceSpeculator;
  // FAILED_PRECONDITION or the device's error when there is none to give.
  absl::Status AttachSpeculator(Session& s) const;
  // OK when `policy` can speculate on a session of `shape` (its skew is
  // here and fits the model, its alpha and budget are in range, the
  // session's past rounds are not in device memory); INVALID_ARGUMENT or
  // FAILED_PRECONDITION saying why. Sets *skew (null when speculation is off).
  absl::Status ResolveSpeculation(const ModelShape& shape, const SessionPolicy& policy,
                                  bool on_device,
                                  std::shared_ptr<const spec::SkewModel>* skew) const;

  SegmentStore* store_;
  EngineOptions options_;
  std::unique_ptr<HandoffCache> handoff_;
  std::unique_ptr<SkewRegistry> own_skews_;  // When the options name none.
  SkewRegistry* skews_;
  DevicePeerFailures device_failures_;
  LinkPool device_links_;
  std::unique_ptr<Executor> own_fetch_executor_;
  Executor* fetch_executor_;
  mutable absl::Mutex mu_;
  std::map<SessionKey, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  // The sum of every session's accounted working-set bytes.
  std::atomic<int64_t> working_set_total_{0};
  std::map<std::string, TenantUse> tenants_ ABSL_GUARDED_BY(mu_);
  // Fetches scheduled and not yet done; the destructor waits for zero.
  absl::Mutex fetches_mu_;
  int fetches_in_flight_ ABSL_GUARDED_BY(fetches_mu_) = 0;
};

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_ENGINE_H_
