// One session of the worker engine: its state machine, working set and the
// attention of one step. Private to worker/ (engine.cc, recall_fetch.cc,
// round_writer.cc, transfer.cc).
#ifndef KVTIER_WORKER_SESSION_H_
#define KVTIER_WORKER_SESSION_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "encoded/encoded_tensor.h"
#include "kernels/codec.h"
#include "kernels/speculation.h"
#include "worker/device/attention.h"
#include "worker/engine.h"
#include "worker/round_layout.h"
#include "worker/rows.h"
#include "worker/segment_store.h"

namespace kvtier::worker {

// One KV head of one layer of a past round: views of its encoded K and V
// [1, len, d], pointing into the segment payload that holds them.
struct HeadKv {
  EncodedView kview, vview;
  int64_t len = 0;
};

struct RoundLayer {
  std::vector<HeadKv> heads;
  int64_t bytes = 0;  // Encoded bytes (the tensors' serialized size), wherever they live.
  // The serialized SegmentPayload the views point into: the very buffer that
  // was sent to (or fetched from) the store, shared by the segment's layers.
  std::shared_ptr<const std::string> payload;
  // This layer's serialized tensors inside `payload` (K, V per head).
  std::vector<std::string_view> tensors;
  // Per tensor, what Crc32cOutsideBufferData covers of it, computed when
  // the tensors were split (MakeLayers): a hand-off's layer checksum takes
  // it from here instead of walking the tensors' fields again in memory that
  // is no longer in cache. Empty when not known.
  std::vector<OutsideCrc> outside;
  // On a device session: the same K/V in device memory. The host views and
  // payload are then dropped, except at layer L_w (recall scores its keys),
  // which keeps a copy of its own tensors only. Shared with a hand-off in
  // flight, which lends the layer to its receiver (CUDA IPC) until the
  // receiver has answered.
  std::shared_ptr<DeviceLayer> device;
  // Speculation's partial keys, per KV head [len, r] in fp16 (the decoded
  // keys, skewed and cut to `partial_skew`'s partial columns), computed the
  // first time a speculating session scores this layer. Guarded by the
  // owning session's lock, like the rest of the working set.
  mutable std::vector<std::vector<uint16_t>> partial;
  mutable const spec::SkewModel* partial_skew = nullptr;
  // Names this `partial` among every layer's of the process (drawn each time
  // it is made): the device keeps a layer's partial keys while the names of
  // the rounds they came from stay the same.
  mutable uint64_t partial_serial = 0;
  // Speculation's fetch counters, per KV head and token: how many decode
  // steps gathered the token. The host pool evicts the least fetched first.
  // Empty until the first gather (all zero). Guarded like `partial`.
  mutable std::vector<std::vector<uint32_t>> fetches;
  // The host pool evicted tokens from this layer: it no longer equals the
  // round's stored segment (or what another worker may hold of the round),
  // so a hand-off sends it in full.
  bool trimmed = false;

  // Head h's fetch counters, sized to its tokens.
  std::vector<uint32_t>& FetchCounts(int h) const {
    if (fetches.size() != heads.size()) fetches.resize(heads.size());
    std::vector<uint32_t>& f = fetches[h];
    if (f.size() != static_cast<size_t>(heads[h].len)) f.resize(heads[h].len, 0);
    return f;
  }
};

// A past round's layer with the round's first position in the conversation
// and its token count when it ended.
struct PlacedRound {
  const RoundLayer* layer;
  int64_t start, tokens;
};

// INVALID_ARGUMENT for a shape no session can have.
absl::Status CheckShape(const ModelShape& shape);

// The watershed layer L_w of a session of `shape` under `policy` (the
// policy's, or L / 3); INVALID_ARGUMENT unless it is below the last layer.
absl::StatusOr<int> WatershedLayer(const ModelShape& shape, const SessionPolicy& policy);

// A name for a RoundLayer's partial keys made or changed now (never 0).
uint64_t NewPartialSerial();

// The working-set form of a segment of `layers` layers from its serialized
// SegmentPayload: views into `payload`, no bytes copied. DATA_LOSS when it
// does not hold 2 tensors per KV head per layer of this model's shape, or,
// with verify_crc, when a tensor's crc32c does not match its buffers.
// Without it the tensors' checksums are not checked again: each hop checks
// once (EndRound just sealed them; a fetched payload's crc32c was checked by
// the store client on arrival). A transfer's receiver checks them here
// (LayerImage::CheckPast), and with `outside_crc` extends it as
// SplitPayload does, in the same pass.
absl::StatusOr<std::vector<std::unique_ptr<RoundLayer>>> MakeLayers(
    std::shared_ptr<const std::string> payload, int layers, int kv_heads, int d,
    bool verify_crc = false, uint32_t* outside_crc = nullptr);

// A serialized SegmentPayload of tensors whose serialized sizes are `sizes`:
// the framing of its repeated field, with write(i, p) putting tensor i's
// bytes at p and returning their end. Each tensor is written once, into the
// returned buffer.
std::string SerializePayload(const std::vector<size_t>& sizes,
                             const std::function<uint8_t*(size_t, uint8_t*)>& write);
// The same of already serialized tensors, in order.
std::string SerializePayload(const std::vector<std::string_view>& tensors);
// Appends what precedes a tensor of `n` bytes in a serialized
// SegmentPayload (its field tag and length): framing + tensor, for every
// tensor in order, is SerializePayload's output.
void AppendPayloadFraming(size_t n, std::string* out);

// What EndRound applies (codec and eviction), checked against the model.
absl::Status ValidateRoundPolicy(const ModelShape& shape, const SessionPolicy& policy);

double MsSince(std::chrono::steady_clock::time_point t);
// `t` in microseconds of the steady clock (CLOCK_MONOTONIC: one clock for
// every process on a host), for debug logs that line up across processes.
int64_t MonoUs(std::chrono::steady_clock::time_point t);

// Widens `count` elements of `dtype` (fp16, bf16 or fp32) at src to fp32.
void WidenRows(DType dtype, const uint8_t* src, int64_t count, float* out);

// One layer of the open round, head-major, so that attention, eviction
// scoring and EndRound read each head's rows in place.
//   k, v: the model's dtype (ModelShape::dtype, `es` bytes per element):
//         head h's row r at element (h * cap + r) * d, rows [0, rows).
//   q:    fp32, only the rows eviction will read (evict::QueriesRead of the
//         round's policy): rows [q_first, rows) of each q head, row r of
//         head h at (h * q_cap + r - q_first) * d. None without eviction.
// Capacities grow by doubling, so appends are amortized.
struct OpenLayer {
  std::vector<uint8_t> k, v;
  std::vector<float> q;
  int64_t cap = 0;   // K/V rows of room per head.
  int64_t rows = 0;  // Rows held: committed tokens plus the step's, if this
                     // layer has seen the step in flight.
  int64_t q_cap = 0, q_first = 0;
  const uint8_t* k_head(int h, int d, int es) const { return k.data() + h * cap * d * es; }
  const uint8_t* v_head(int h, int d, int es) const { return v.data() + h * cap * d * es; }
  // Bytes held (capacity), for tests and accounting.
  size_t HeldBytes() const { return k.capacity() + v.capacity() + q.capacity() * sizeof(float); }
};

// The open round's rows [first, rows) of K and V as fp32, token-major
// [rows - first, kv_heads, d]: what the step's new rows look like as they
// arrive, and how the GPU's mirror of the open round holds them (a session
// arriving in a hand-off loads its open round into the mirror this way).
void OpenRowsTokenMajor(const OpenLayer& o, int kv_heads, int d, DType dtype, int64_t rows,
                        std::vector<float>* k, std::vector<float>* v, int64_t first = 0);

// Uploads `rl` to the GPU (UploadLayer, readable back for a hand-off) and
// drops its host bytes: a past round's layer other than L_w on a session
// whose working set is on the GPU.
absl::Status MoveToDevice(RoundLayer& rl, int head_dim);

// What a receiver does of an import as its layers arrive
// (Engine::BeginImport): per layer the open round, made into the session's
// open layer (ImportSession takes it); and for a session going on the GPU,
// its device working set, with each layer's travelled rounds uploaded and
// its open round loaded into the device's mirror.
struct PreparedImport {
  std::unique_ptr<DeviceSession> device;  // Null: the session stays in host memory.
  ModelShape shape;
  int lw = 0;
  std::vector<std::optional<OpenLayer>> open;
};

// Where a session is in its round. Transitions (one place each):
//   kIdle    --PrefillLayer(0)-->           kPrefill
//   kOpen    --PrefillLayer(0)-->           kPrefill
//   kOpen    --DecodeLayer(0)-->            kDecode
//   kPrefill/kDecode --last layer-->        kOpen     (the step's tokens commit)
//   kPrefill/kDecode --failure, AbortStep-->kOpen, or kIdle when the round
//                                           had no committed token
//   kOpen    --EndRound plans-->            kEnding   (lock released to send)
//   kEnding  --puts OK-->                   kIdle     (the round is a past round)
//   kEnding  --puts fail-->                 kOpen     (EndRound may be retried)
enum class SessionState { kIdle, kOpen, kPrefill, kDecode, kEnding };
const char* StateName(SessionState s);

// Where the open round is in its recall (done once, by its first prefill).
//   kNone --L_w with past rounds-->  kFetching (one GetSegments in flight)
//                                    or kReady (everything resident)
//   kFetching --L_w + 1 installs-->  kReady
//   any --rollback of the first prefill, EndRound--> kNone
enum class RecallState { kNone, kFetching, kReady };

// The one GetSegments of a recall, shared by the session and the task that
// runs it, so that a session that rolls back or closes never waits for it.
struct Engine::Fetch {
  absl::Notification done;
  absl::StatusOr<std::vector<std::string>> result;  // Set before `done`.
  // Per segment: the store no longer has it (its round was dropped under
  // pressure); its entry in `result` is empty.
  std::vector<bool> gone;
  double ms = 0;
};

// Thread-safe through `mu`: the engine locks it around every access (the
// fields are guarded by it), and never holds it across a store call.
class Engine::Session {
 public:
  struct PastRound {
    uint32_t round = 0;
    int64_t tokens = 0;
    std::vector<std::unique_ptr<RoundLayer>> layers;  // Null: not resident.
    uint64_t stored_bytes = 0;
    // The store dropped the round (memory or disk pressure): its upper
    // layers cannot come back, so recall no longer selects it.
    bool upper_gone = false;
    // Bit i: the round has left every window of the sliding segment
    // layout[i]; its layers there are gone from the working set and the
    // store, and nothing fetches them again.
    uint64_t left = 0;
  };

  // `clock` (not owned) outlives the session: the engine's.
  Session(SessionKey session_key, const ModelShape& model, const SessionPolicy& p, int watershed,
          Clock* time)
      : key(std::move(session_key)),
        shape(model),
        lw(watershed),
        layout(RoundLayout(model, watershed)),
        clock(time),
        last_active_ms(time->NowUnixMs()),
        policy(p),
        round_eviction(p.eviction) {}

  // Store calls for this session: `call` acting for the session's tenant.
  CallOptions ForStore(CallOptions call) const {
    call.tenant = key.tenant;
    return call;
  }

  // Immutable after construction.
  const SessionKey key;
  // Its tenant's totals in the engine (set by OpenSession before the session
  // is shared; the entry outlives it).
  TenantUse* tenant = nullptr;
  const ModelShape shape;
  const int lw;  // The resolved watershed layer L_w.
  // How each round is stored (at most 64 segments, CreateSession checks).
  const std::vector<SegmentSpan> layout;
  // The layout segment that holds a layer.
  const SegmentSpan& SpanOf(int layer) const {
    for (const SegmentSpan& sp : layout) {
      if (layer < sp.end) return sp;
    }
    return layout.back();
  }
  Clock* const clock;  // The engine's (EngineOptions::clock).
  // clock's milliseconds at the last step or EndRound (or the open).
  std::atomic<int64_t> last_active_ms;

  mutable absl::Mutex mu;
  // Changes only through Engine::UpdatePolicy (the watershed layer never).
  SessionPolicy policy ABSL_GUARDED_BY(mu);
  SessionState state ABSL_GUARDED_BY(mu) = SessionState::kIdle;
  RecallState recall ABSL_GUARDED_BY(mu) = RecallState::kNone;
  std::vector<PastRound> past ABSL_GUARDED_BY(mu);
  // Names this life of the session (random, drawn when it opens; a hand-off
  // carries it): with a round number it names the round's bytes, which a
  // worker that kept them need not receive again (HandoffCache).
  uint64_t incarnation ABSL_GUARDED_BY(mu) = 0;
  // The open round, per layer, head-major: what attention reads per head,
  // what eviction scores and what EndRound encodes, without a transpose.
  std::vector<OpenLayer> open ABSL_GUARDED_BY(mu);
  // The open round's eviction: the policy's when the round opened (a policy
  // change applies from the next round), which says which queries to keep.
  evict::Policy round_eviction ABSL_GUARDED_BY(mu);
  int64_t tokens ABSL_GUARDED_BY(mu) = 0;  // Committed tokens of the open round.
  // The step in flight (kPrefill, kDecode): layers done so far, token count.
  int next_layer ABSL_GUARDED_BY(mu) = 0;
  int64_t step_n ABSL_GUARDED_BY(mu) = 0;
  // Past rounds (indices into `past`) attended above L_w in this round.
  std::vector<size_t> selected ABSL_GUARDED_BY(mu);
  // The recall fetch (kFetching) and what it brings, in order: per segment,
  // the past round (index into `past`) and its layout segment.
  std::shared_ptr<Fetch> fetch ABSL_GUARDED_BY(mu);
  struct FetchedSegment {
    size_t round = 0;
    uint32_t segment = 0;
  };
  std::vector<FetchedSegment> fetch_segments ABSL_GUARDED_BY(mu);
  // Set when the working set is on the GPU.
  std::unique_ptr<DeviceSession> device ABSL_GUARDED_BY(mu);
  // Set when a speculating session speculates and attends on the GPU
  // (InfiniGen's split): its past rounds stay in the host pool, and
  // DecodeOnDevice runs its decode steps. Never with `device`.
  std::unique_ptr<DeviceSpeculator> spec_device ABSL_GUARDED_BY(mu);
  // Rounds the open round recalled without a fetch, and earlier ones whose
  // report to the store failed (one entry per recall).
  std::vector<uint32_t> round_resident ABSL_GUARDED_BY(mu), unreported_recalls ABSL_GUARDED_BY(mu);
  // Sliding segments of rounds that left their windows and that the store
  // has not yet confirmed dropped: sent again at the next EndRound.
  std::vector<SegmentStore::Segment> pending_drops ABSL_GUARDED_BY(mu);
  SessionStats stats ABSL_GUARDED_BY(mu);
  // Speculation (policy.speculation): the skew it names, the gathered K/V
  // of the next layer's speculated tokens, and the round's figures.
  std::shared_ptr<const spec::SkewModel> skew ABSL_GUARDED_BY(mu);
  struct Gather {
    int layer = -1;  // The layer it is for; -1: none.
    // Per KV head, the union of the group's speculated tokens, fp32 [u, d].
    std::vector<std::vector<float>> k, v;
    spec::Speculated picked;  // Kept on a sampled step, for the hit rate.
    bool sample = false;
  };
  Gather gather ABSL_GUARDED_BY(mu);
  std::vector<SpeculationLayerStats> spec_stats ABSL_GUARDED_BY(mu);
  uint64_t decode_steps ABSL_GUARDED_BY(mu) = 0;  // Of the open round.
  static constexpr uint64_t kHitSampleEvery = 16;
  // Working-set bytes this session has added to the engine's total.
  int64_t accounted ABSL_GUARDED_BY(mu) = 0;

  // OK when q [n, Hq, d], k and v [n, Hkv, d] are fp32, fp16 or bf16 and
  // hold only values this session can store; INVALID_ARGUMENT naming the
  // layer and the element.
  absl::Status CheckValues(int layer, int64_t n, const Rows& q, const Rows& k, const Rows& v) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Bytes of n tokens at every layer in the model's dtype: what the open
  // round counts in the working set, and what the full cache holds.
  int64_t TokenBytes(int64_t n) const {
    return n * shape.layers * shape.kv_heads * shape.head_dim * 2 * shape.dtype_bytes();
  }

  // OK when `layer` of a step of n tokens (prefill or decode) may run now;
  // FAILED_PRECONDITION or INVALID_ARGUMENT saying why not.
  absl::Status CheckStep(int layer, int64_t n, bool prefill) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Layer 0 of a step: enters kPrefill/kDecode.
  void BeginStep(int64_t n, bool prefill) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // On a device session, uploads `rl` (a layer of a past round) and drops its
  // host tensors unless it is layer L_w. Nothing to do on a host session.
  absl::Status Place(RoundLayer& rl, int layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A round's layer that arrived in device memory (CUDA IPC): kept there on
  // a device session, except at layer L_w; read back into host tensors
  // otherwise (for L_w, Place then uploads it again).
  absl::StatusOr<std::unique_ptr<RoundLayer>> FromDevice(const LayerImage::DeviceRound& dr,
                                                         int layer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  uint64_t DeviceBytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  int64_t WorkingSetBytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void NotePeak() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // The past rounds' layer data a token attends at `layer`: every resident
  // round up to L_w, the recalled ones above it.
  std::vector<const RoundLayer*> Visible(int layer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The same with each round's first position in the conversation and its
  // token count when it ended (a sliding layer's window is in positions).
  std::vector<PlacedRound> VisiblePlaced(int layer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Tokens of the past rounds: the open round's first position.
  int64_t PastTokens() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Marks every sliding segment that a past round has left for queries at
  // position `next` and later (round_layout.h, LeftWindow), releasing its
  // layers from the working set. Returns the newly left segments, for the
  // store to drop. A model with no sliding layer has none.
  std::vector<SegmentStore::Segment> MarkLeftWindows(int64_t next)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Whether past round `i` is missing layer `l` because it left the window
  // there (not an error).
  bool LeftAt(size_t i, int l) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return (past[i].left >> SpanOf(l).index & 1) != 0;
  }

  // Appends n tokens' q [n, Hq, d] (fp32), k and v [n, Hkv, d] (token-major,
  // as they arrive) to the open round at `layer`, scattering them head-major.
  // K/V rows already in the model's dtype are copied; others are converted
  // (counted in stats.converted_kv_values).
  void Append(int layer, int64_t n, const float* q, const Rows& k, const Rows& v)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Attends the n tokens appended last at `layer` (q, and their k and v as
  // given to Append, in fp32; read only on the device path, null elsewhere)
  // over the visible past rounds plus the open round (positions
  // tokens..tokens+n-1, causally); rolls the step back on failure.
  absl::Status Attend(int layer, int64_t n, const float* q, const float* k, const float* v,
                      float* out, KernelLevel level) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Speculation for `layer` from its approximate query q_next [q_heads, d]
  // (a decode step at layer - 1): scores the visible past rounds' partial
  // keys, picks the tokens and gathers their K/V into `gather`, which the
  // step's Attend at `layer` then reads instead of the past rounds.
  void Speculate(int layer, const float* q_next, KernelLevel level)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // What speculation at `layer` reads: the visible past rounds (their
  // partial keys made) and each KV head's past tokens in them.
  struct SpecInputs {
    std::vector<const RoundLayer*> vis;
    std::vector<int64_t> total;  // Per KV head.
    int64_t t_max = 0;
  };
  SpecInputs SpecInputsAt(int layer, KernelLevel level) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Gathers the K/V of `picked` (the tokens speculation chose at `layer`)
  // from the host pool into `gather`, counting fetches and figures.
  void GatherPicked(int layer, const SpecInputs& in, spec::Speculated picked, KernelLevel level)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A decode step's layer on a session with spec_device: the attention at
  // `layer` on the GPU over the tokens gathered for it (on the CPU over the
  // visible rounds when none were), and with q_next the selection of layer
  // + 1's tokens on the GPU's other stream meanwhile, their gather from the
  // pool and upload. Rolls the step back on failure.
  absl::Status DecodeOnDevice(int layer, const float* q, float* out, const float* q_next,
                              KernelLevel level) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // On a sampled step, scores `gather.picked` against this step's true
  // query q at `layer` (spec::Score) into spec_stats.
  void SampleHitRate(int layer, const float* q, KernelLevel level)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // The host pool (policy.speculation.pool_bytes, docs/speculation.md):
  // with the pool above its cap, evicts tokens of the resident past rounds
  // at layers 1 to L - 1, fewest fetches first among each layer and KV
  // head's older half (then the older half of what is left, until the pool
  // fits or one token per layer and head is left), and re-encodes the round
  // layers that lost tokens with `codec`. Host sessions only; nothing to do
  // without a cap. An error leaves the working set as it was.
  absl::StatusOr<PoolTrim> TrimPool(const CodecConfig& codec, KernelLevel level)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Marks `layer` done; after the last layer the step's n tokens commit.
  void EndLayer(int64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Drops the step in flight: the open round goes back to `tokens`. A fetch
  // in flight is abandoned (its task finishes on its own).
  void RollBackStep() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Clears the open round after EndRound stored it.
  void CloseRound() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_SESSION_H_
