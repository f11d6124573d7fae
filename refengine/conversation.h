// The reference engine (issue 5): a llama2.c model holding a multi-round
// conversation on token ids, with attention either in process over the full
// cache (local mode, the ground truth) or in kvtier-worker over gRPC (tier
// mode). Each round: the question's tokens as one prefill, then
// `answer_tokens` greedy decode steps, then EndRound.
#ifndef KVTIER_REFENGINE_CONVERSATION_H_
#define KVTIER_REFENGINE_CONVERSATION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/session_router.h"
#include "client/worker_client.h"
#include "grpcpp/channel.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "model/forward.h"

namespace kvtier::refengine {

struct ConversationOptions {
  int rounds = 20;
  int question_tokens = 10;  // Per round, taken from a sequence sampled from the model.
  int answer_tokens = 15;    // Greedy decode steps per round.
  uint64_t seed = 1;
};

struct Transcript {
  std::vector<std::vector<int>> questions, answers;
  // Per round, the logits of each answer position [answer_tokens, vocab].
  std::vector<std::vector<float>> logits;
  double decode_ms_per_token = 0;  // Mean wall time of one decode step.
};

// A conversation's attention: model::LayerAttention plus the round events.
class ConversationBackend : public model::LayerAttention {
 public:
  // Called before each step (a prefill of `n` tokens or one decode token).
  virtual absl::Status BeginStep(bool prefill, int n, int question_tokens) = 0;
  virtual absl::Status EndStep() = 0;
  virtual absl::Status EndRound() = 0;
  // After a step or EndRound of round `round` failed with `failure`: puts
  // the session where it can go on (its worker again, or another one,
  // resumed from the store) and returns the round to continue at: `round`
  // (its steps must be sent again from the round's first token) or
  // `round + 1` (the failed EndRound had stored it). Returns `failure` when
  // nothing can be done. Default: nothing can.
  virtual absl::StatusOr<uint32_t> Recover(uint32_t round, const absl::Status& failure) {
    (void)round;
    return failure;
  }
};

// Local mode: the full fp32 cache.
std::unique_ptr<ConversationBackend> LocalBackend(const model::ModelConfig& c);

// What kvtier-worker reported for one round of a tier-mode session.
struct TierRound {
  uint32_t round = 0;
  bool recalled = false;           // False for round 0 (nothing to recall).
  std::vector<uint32_t> selected;  // Past rounds attended above L_w.
  std::vector<float> scores;       // Normalized qAttention per past round.
  uint64_t bytes_fetched = 0;      // The one GetSegments call's payload.
  uint32_t fetched_segments = 0;
  double fetch_ms = 0, exposed_ms = 0;
  uint64_t stored_bytes = 0;             // PutSegment payloads of this round.
  uint64_t round_working_set_bytes = 0;  // Before EndRound.
  uint64_t full_cache_bytes = 0;         // The session's, this round included.
  uint64_t working_set_after = 0;        // After EndRound's release.
  // The worker process's memory after EndRound (all of its sessions).
  v1::ProcessMemory worker_memory;
  // The round's first prefill step, from its first layer sent to its last
  // output (with a hand-off, the receiver's answer included): the time to
  // first token without the decode step.
  double prefill_ms = 0;
  // Prefill/decode disaggregation (TierBackend with a Disaggregation): the
  // hand-off after the prefill (LayerResponse.transfer) and the hand-back
  // after EndRound (SendSession).
  bool handed_off = false;
  std::string transfer_path;
  uint64_t transfer_wire_bytes = 0;
  uint64_t transfer_raw_bytes = 0;  // The same state in the model's dtype.
  double transfer_ms = 0, transfer_exposed_ms = 0;
  // The exposed part's breakdown (TransferReport): the stream catching up
  // with the prefill, the tail's wait behind the layers the decode worker
  // was still taking, and its import; and the decode worker's device work
  // during the stream.
  double transfer_drain_ms = 0, transfer_import_ms = 0, transfer_device_copy_ms = 0,
         transfer_tail_wait_ms = 0, transfer_receiver_span_ms = 0, transfer_receiver_busy_ms = 0;
  uint64_t return_wire_bytes = 0;
  // Past rounds' bytes the receiving worker still held from an earlier
  // hand-off, so they did not travel (TransferReport.reused_bytes).
  uint64_t transfer_reused_bytes = 0, return_reused_bytes = 0;
  double return_ms = 0;
  // The hand-back's path, and the bytes each direction copied device to
  // device (CUDA IPC; not in the wire bytes). When a session on the GPU went
  // over gRPC all the same, why (TransferReport.device_refusal).
  std::string return_path;
  uint64_t transfer_device_bytes = 0, return_device_bytes = 0;
  std::string device_refusal;
  // Of the hand-off and the hand-back, how many used an NCCL communicator
  // kept from an earlier one (TransferReport.device_link_reused).
  int nccl_links_reused = 0;
  // Per layer, what speculation did in the round (EndRoundResponse);
  // empty when the session does not speculate.
  std::vector<v1::SpeculationLayer> speculation;
  // The host pool's trim at the round's EndRound (unset: no pool cap).
  v1::SpeculationPool pool;
};

// A round's report from the worker's EndRound answer and, when the round
// recalled, the recall decision its prefill returned (both session kinds,
// remote and in process, build their TierRounds here).
TierRound RoundReport(const v1::EndRoundResponse& end, const v1::RecallDecision* recall,
                      double prefill_ms);

// Tier mode: every layer's attention in kvtier-worker over Prefill/Decode
// streams, and the worker's per-round reports.
class TierSession : public ConversationBackend {
 public:
  virtual const std::vector<TierRound>& rounds() const = 0;
  // The policy the worker applies (defaults filled in, L_w resolved).
  virtual const v1::Policy& effective_policy() const = 0;
  // The worker holds this session's working set in GPU memory.
  virtual bool on_device() const = 0;
  // The worker speculates for this session on its GPU.
  virtual bool speculation_on_device() const = 0;
  // CloseSession; with `delete_from_store` the store forgets the rounds.
  virtual absl::Status Close(bool delete_from_store) = 0;
};

// How long each call of a tier session may take; past it the call fails
// DEADLINE_EXCEEDED instead of waiting on a stopped worker or store.
struct TierDeadlines {
  // OpenSession, EndRound, CloseSession. Default: 30 s.
  absl::Duration call = absl::Seconds(30);
  // One prefill step's stream (every layer, the recall fetch included).
  // Default: 30 s.
  absl::Duration step = absl::Seconds(30);
  // The Decode stream, which carries every decode step of one round.
  // Default: 300 s.
  absl::Duration round = absl::Seconds(300);
};

// A failover of a cluster session: its worker failed a call, and the
// session went on from the store on `to`.
struct Failover {
  uint32_t round = 0;     // The round that was open.
  std::string from, to;   // Worker node ids (equal: resumed on the same one).
  std::string failure;    // The status that started it.
  double recover_ms = 0;  // From the failure to the resumed session.
};

// A tier session in a kvtier cluster (client/session_router.h): routed
// through kvtier-controller, opened with the route's store replicas, and
// moved when its worker fails. EndRound failures caused by a store (the
// worker still answers) are retried for up to `store_failover` so that the
// controller can replace the store; other failures go to Recover.
class ClusterSession : public TierSession {
 public:
  virtual const std::vector<Failover>& failovers() const = 0;
  virtual std::string worker_node_id() const = 0;
  virtual std::vector<std::string> store_node_ids() const = 0;
  // Asks the controller where the session is now (store replicas change
  // without the engine noticing).
  virtual absl::Status RefreshRoute() = 0;
};

// The ModelSpec of a llama2.c checkpoint (fp32, as the reference model runs).
v1::ModelSpec SpecOf(const model::ModelConfig& c);

// OpenSession with any model spec; q/k/v go over the wire in its dtype. With
// `decode` (not owned; it must outlive the session), decode steps go through
// that shared stream; without, the session keeps a Decode stream of its own
// per round.
//
// With `pd`, prefill and decode run on two workers: each round's prefill on
// `channel`'s worker hands the session to `pd->decode_target` layer by layer
// (LayerRequest.transfer_to), decode steps and EndRound run there, and
// SendSession hands the session back for the next round's prefill. `decode`
// must then be a mux on the decode worker.
struct Disaggregation {
  std::shared_ptr<grpc::Channel> decode_channel;
  std::string prefill_target, decode_target;  // host:port, as the workers reach each other.
};

absl::StatusOr<std::unique_ptr<TierSession>> TierBackend(
    const v1::ModelSpec& spec, std::shared_ptr<grpc::Channel> channel, const std::string& session,
    const v1::Policy& policy, const std::string& token = "", const TierDeadlines& deadlines = {},
    DecodeMux* decode = nullptr, const Disaggregation* pd = nullptr);

// A session routed through `router` (not owned; it must outlive the
// session). Decode steps use a stream of the session's own. `store_failover`:
// how long EndRound retries while the worker answers but a store does not.
// `skew`: a skew file's bytes to speculate with (docs/speculation.md); it is
// uploaded to every worker the session opens on (its decode worker too) and
// named in the policy. Empty: the policy as given.
absl::StatusOr<std::unique_ptr<ClusterSession>> ClusterBackend(
    const v1::ModelSpec& spec, SessionRouter* router, const std::string& session,
    const v1::Policy& policy, const std::string& token = "", const TierDeadlines& deadlines = {},
    absl::Duration store_failover = absl::Seconds(15), const std::string& skew = "");

// Runs the conversation. With `teacher`, the answers are the teacher's
// tokens (teacher forcing: the same context as the teacher had), and the
// logits are this backend's; without, answers are greedy. `progress` gets
// one line per round when set. When a round fails and the backend recovers
// (ConversationBackend::Recover), the round is sent again from its first
// token, with the answer tokens already produced (up to 3 times a round).
absl::StatusOr<Transcript> RunConversation(const model::Model& m, const ConversationOptions& o,
                                           ConversationBackend* b, const Transcript* teacher,
                                           const std::function<void(const std::string&)>& progress);

// One round of a conversation given token by token: the user's tokens as
// one prefill step, then the assistant's tokens, each a decode step
// (teacher forcing: the logits before each are recorded, and the given
// token is fed whatever the backend predicted).
struct ScriptRound {
  std::vector<int> user;       // >= 1 token.
  std::vector<int> assistant;  // >= 1 token.
};

// Runs a scripted conversation (kvtier-engine --conversations, refengine/
// replay.h). Transcript.questions/answers are the script's tokens and
// logits[r] holds [assistant tokens, vocab]. INVALID_ARGUMENT when a round
// is empty, a token is outside the vocabulary or the conversation does not
// fit the model's context. Failures are recovered as in RunConversation.
// With `sink`, each round's logits go to it once the round is complete
// (its EndRound done), in round order, instead of into Transcript.logits
// (whose entries stay empty): a conversation's logits over a large
// vocabulary need not all be held. A sink's error ends the run with it.
using RoundSink = std::function<absl::Status(int round, std::vector<float> logits)>;
struct ScriptOptions {
  // Each round's answer as one prefill step after the question's (every
  // position's logits from it) instead of a decode step per token: the same
  // logits up to rounding for every method but speculation (which acts at
  // decode steps), at a fraction of the time. Transcript's
  // decode_ms_per_token is then the answer prefill's time per token.
  bool answer_prefill = false;
};
absl::StatusOr<Transcript> RunScript(const model::Model& m, const std::vector<ScriptRound>& rounds,
                                     ConversationBackend* b,
                                     const std::function<void(const std::string&)>& progress,
                                     const RoundSink& sink = nullptr,
                                     const ScriptOptions& options = {});

struct Agreement {
  double top1 = 0;  // Fraction of answer positions whose argmax matches.
  double kl = 0;    // Mean KL(teacher || this) in nats.
  double max_logit_diff = 0;
};
Agreement Compare(const Transcript& teacher, const Transcript& t, int vocab);

// Compare, a round at a time: Add each round's positions as they come.
class AgreementSum {
 public:
  // `positions` rows of `vocab` logits each, the teacher's and the other's.
  void Add(const float* teacher, const float* t, size_t positions, int vocab);
  Agreement Result() const;

 private:
  int64_t n_ = 0, agree_ = 0;
  double kl_ = 0, max_logit_diff_ = 0;
};

}  // namespace kvtier::refengine

#endif  // KVTIER_REFENGINE_CONVERSATION_H_
