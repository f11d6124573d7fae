// The multi-round chat workload behind `make demo` (kvtier-engine): several
// sessions, each a conversation of many rounds, served by kvtier-worker
// (with kvtier-store behind it) and, beside it, by an in-process full cache
// as the ground truth. Two workloads:
//  - the embedded synthetic chat (traces/synthetic_chat.h): fidelity is the
//    relative error of the attention outputs;
//  - a llama2.c checkpoint (the reference engine): fidelity is top-1
//    agreement and KL of the next-token distribution, teacher-forced on the
//    local run's greedy answers.
#ifndef KVTIER_REFENGINE_DEMO_H_
#define KVTIER_REFENGINE_DEMO_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvtier/v1/worker.pb.h"
#include "refengine/conversation.h"
#include "refengine/replay.h"

namespace kvtier::refengine {

struct DemoOptions {
  std::string worker;  // kvtier-worker "host:port". Required without `controller`.
  // kvtier-controller "host:port": sessions are routed through it, kept on
  // store replicas, and fail over to another worker when theirs dies
  // (ClusterSession). Empty: the one `worker`.
  std::string controller;
  // A second kvtier-worker "host:port" that decodes: each round's prefill
  // on `worker` is handed off to it layer by layer, and handed back after
  // EndRound (docs/transfer.md). Empty: one worker does both.
  std::string decode_worker;
  // PEM of the CA of the workers' certificates: every channel to a worker
  // is TLS (the name expected in them: `worker_tls_server_name`, else the
  // address's host). Empty: plaintext.
  std::string worker_tls_root_certs;
  std::string worker_tls_server_name;
  // PEM of the engine's own certificate chain and key, presented to
  // workers (and the controller) that require one (mutual TLS); empty: none.
  std::string tls_cert_chain, tls_private_key;
  // PEM of the CA of the controller's certificate: Route over TLS. Empty:
  // plaintext.
  std::string controller_tls_root_certs;
  // PEM of the CA of the store's certificate (`store`, and the in-process
  // engine's store): TLS. Empty: plaintext.
  std::string store_tls_root_certs;
  std::string store;  // kvtier-store "host:port": per-tier bytes; optional.
  std::string token;  // Bearer token for both; empty: none.
  std::string model;  // llama2.c checkpoint; empty: the synthetic chat.
  // A JSON Lines file of conversations in token ids (refengine/replay.h)
  // to replay instead of generated ones; needs `model`. Each conversation
  // is a session; `sessions` of them run at a time; `rounds`, the token
  // counts and `seed` do not apply.
  std::string conversations;
  // With `conversations`: each round's answer goes as one prefill step, all
  // its positions scored from it (ScriptOptions.answer_prefill); the fast
  // way to score a method, not for speculation (which acts at decode
  // steps) nor for decode timings. Default: one decode step per token.
  bool answer_prefill = false;
  // With `conversations`: a directory of the full cache's logits
  // (refengine/teacher_cache.h). A conversation found there is scored
  // against them instead of running the full cache again; one that is not
  // is run and added. For replays of the same conversations under several
  // policies. Empty: the full cache runs beside the tier every time.
  std::string teacher_cache;
  int sessions = 4;
  int rounds = 24;
  // Per round; 0 takes the workload's default (synthetic 16 + 16, model
  // 10 + 11 so that 24 rounds fit stories260K's 512-token context).
  int question_tokens = 0;
  int answer_tokens = 0;
  std::string codec = "raw";         // kernels/codec.h ParseCodecSetting.
  std::string recall = "mass:0.95";  // kernels/recall.h ParseRecall.
  // "none", "METHOD:BUDGET[:k=v...]" or "profile:FILE[:w=...]" (an EvolKV
  // layer profile, read here; its budgets go on the wire).
  std::string evict = "none";
  // L_w; -1: the synthetic chat's measured one (6, `kvtier eval watershed`),
  // or the worker's default (L / 3) for a model.
  int watershed = -1;
  uint64_t seed = 1;
  // Every session's decode layers on one long-lived Decode stream, batched
  // (DecodeMux); false: a stream per session and round, one item each.
  // Default: true.
  bool shared_decode_stream = true;
  // How old the shared stream gets before new steps move to a fresh one
  // (DecodeMux's rotate_after); unset: half its deadline.
  std::optional<absl::Duration> decode_stream_rotate;
  // Session ids are "<prefix><i>"; empty picks "chat-<run id>-" so that
  // runs against the same store do not collide.
  std::string session_prefix;
  // Delete the sessions' rounds from the store at the end (after the
  // report's store figures are read).
  bool delete_at_end = true;
  // Speculative token selection (docs/speculation.md):
  // "ALPHA[:BUDGET[:POOL_BYTES[:LOW_BYTES]]]" turns it on (POOL_BYTES: the
  // host pool's cap per session; LOW_BYTES: where its trims stop), with `skew` the skew file of
  // `model` (kvtier calibrate infinigen), uploaded to the worker(s) at the start (in a cluster, to
  // each worker a session opens on). Needs `model` (the engine computes the
  // next layer's query from the weights). Empty: off.
  std::string speculation;
  std::string skew;
  // In-process mode (refengine/inproc.h): the worker engine runs in this
  // process over `store`, and no kvtier-worker is used (`worker` must be
  // empty). Attention costs no hop per layer.
  bool inproc = false;
};

// The wire policy for codec/recall/evict/watershed texts. INVALID_ARGUMENT
// with the offending text.
absl::StatusOr<v1::Policy> DemoPolicy(const DemoOptions& o);

struct DemoSession {
  std::string id;
  std::vector<TierRound> rounds;
  std::vector<std::vector<int>> references;        // Synthetic: each round's true references.
  double tier_decode_ms = 0, local_decode_ms = 0;  // Sums over decode tokens.
  int64_t decode_tokens = 0;
  double err2 = 0, ref2 = 0;  // Synthetic: sums of squares of (tier - local) and local.
  // Synthetic: CRC-32C of every attention output the tier returned, layer by
  // layer and step by step (a step sent again after a failover counts once).
  uint32_t outputs_crc32c = 0;
  Agreement agreement;                 // Model.
  bool on_device = false;              // The worker held the working set in GPU memory.
  bool speculation_on_device = false;  // The worker speculated on its GPU.
  // Cluster runs: where the session ended up (node ids) and its failovers.
  std::string worker;
  std::vector<std::string> stores;
  std::vector<Failover> failovers;
  // Replay: the conversation's id and line, and each round's scores.
  std::string conversation, where;
  std::vector<ReplayRoundScore> replay;
  // The full cache's logits came from DemoOptions.teacher_cache (its
  // local_decode_ms is then the time measured when they were written).
  bool teacher_cached = false;
  // Replay of a file whose rounds say what their answers must contain
  // ("expect") on a model with a tokenizer: each such answer as text, the
  // greedy tokens over the round's scored span, and whether it contains the
  // value (case-insensitive).
  struct Answer {
    int round = 0;
    std::string question, expect, full_cache, kvtier;
    bool full_cache_right = false, kvtier_right = false;
  };
  std::vector<Answer> answers;
};

struct DemoReport {
  std::string workload;         // "synthetic-chat" or the checkpoint path.
  std::string conversations;    // Replay: the file.
  bool answer_prefill = false;  // DemoOptions.answer_prefill.
  std::string policy;           // Human-readable effective policy.
  int layers = 0, watershed = 0, tokens_per_round = 0, rounds = 0;
  int kv_heads = 0;  // The model's (0 for the synthetic chat).
  // Segments each round is stored as (worker/round_layout.h).
  int segments_per_round = 2;
  std::vector<DemoSession> sessions;
  std::optional<uint64_t> store_bytes_ram, store_bytes_disk;
  std::optional<v1::ProcessMemory> store_memory;  // From Store.Stats at the end.
  double seconds = 0;
  // Decode traffic on the shared stream: requests sent and the session-layer
  // items they carried (items / requests = the mean batch).
  uint64_t decode_requests = 0, decode_items = 0;
  std::string speculation;  // DemoOptions::speculation, when on.
  bool inproc = false;      // The worker engine ran in this process.
};

// Runs the sessions concurrently. `progress` gets one line per round.
absl::StatusOr<DemoReport> RunDemo(const DemoOptions& o,
                                   const std::function<void(const std::string&)>& progress);

std::string RenderText(const DemoReport& r);
// Synthetic: the sessions' outputs_crc32c combined in session order. Two
// runs of the same workload whose tiers returned bit-identical outputs (one
// worker, or prefill and decode on two) have the same digest.
uint32_t OutputsDigest(const DemoReport& r);
// The JSON report: sessions, rounds, full_cache_bytes, working_set_bytes,
// working_set_ratio, store_bytes_ram, store_bytes_disk, recall_calls,
// recall_rounds_selected, decode_ms_per_token, attn_rel_err, top1_agreement
// (null where it does not apply), and more (docs/demo.md).
std::string RenderJson(const DemoReport& r);

}  // namespace kvtier::refengine

#endif  // KVTIER_REFENGINE_DEMO_H_
