// The kvtier.v1.Worker service on gRPC's callback API, over worker::Engine.
// Shaped like kvtier-store's service: unary calls finish from an executor,
// streams are reactors that own their state and delete themselves in
// OnDone(), and no callback ever blocks: attention runs on the compute
// executor, calls that reach the store (EndRound, CloseSession) on the io
// executor, and the engine never holds a session lock across a store call.
#ifndef KVTIER_SERVICES_WORKER_WORKER_SERVICE_H_
#define KVTIER_SERVICES_WORKER_WORKER_SERVICE_H_

#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "base/executor.h"
#include "grpcpp/support/server_callback.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "services/common/auth.h"
#include "services/worker/controller_policies.h"
#include "services/worker/known_nodes.h"
#include "services/worker/replicated_segments.h"
#include "services/worker/session_sender.h"
#include "services/worker/worker_metrics.h"
#include "worker/engine.h"
#include "worker/transfer.h"

namespace kvtier {

struct WorkerServiceOptions {
  // Deadline of the store calls an RPC makes when its caller set none (a
  // caller's deadline is passed on as is). Default: 10 s.
  absl::Duration store_deadline = absl::Seconds(10);
  // Largest output slice per LayerResponse (o is split by tokens above it).
  // Default: 1 MiB.
  size_t max_response_bytes = size_t{1} << 20;
  // Prefill/decode disaggregation (docs/transfer.md): a prefill worker
  // refuses Decode, a decode worker refuses Prefill (FAILED_PRECONDITION
  // saying where to send it); sessions reach a decode worker by hand-off.
  // Default: both.
  enum class Role { kBoth, kPrefill, kDecode };
  Role role = Role::kBoth;
  // TLS on the channels this worker opens to other workers (hand-offs): the
  // PEM of the CA that signed their certificates; empty = plaintext. A peer
  // that serves TLS (--tls_cert) is reachable only this way.
  std::string peer_tls_root_certs;
  // The name expected in peers' certificates, instead of the target's host.
  std::string peer_tls_server_name;
  // PEM of this worker's own certificate chain and key, presented to peers
  // that require client certificates (mutual TLS); empty: none.
  std::string peer_tls_cert_chain, peer_tls_private_key;
  // PutSkew streams one tenant (the caller's token) may have open at once,
  // and the bytes they may hold together before each parses; past either,
  // RESOURCE_EXHAUSTED naming the limit. Both bind only with
  // authentication (without it every caller is one tenant). 0: no limit.
  // Defaults: 4 streams, 256 MiB (one skew file of the largest size).
  int skew_uploads_per_tenant = 4;
  uint64_t skew_upload_bytes_per_tenant = uint64_t{256} << 20;
  // A PutSkew stream that waits this long for its client's next message is
  // ended, DEADLINE_EXCEEDED, and what it gathered is dropped. Zero: never.
  // Default: 30 s.
  absl::Duration skew_upload_idle = absl::Seconds(30);
};

// Thread-safe; the pointers are not owned and must outlive the service (and
// the server it is registered with).
//
// Every method is "raw": the service parses its requests itself
// (rpc/wire_format.h), so a message that does not parse is INVALID_ARGUMENT
// with a reason, on streams too, instead of gRPC's bare INTERNAL or a stream
// that just ends, and TransferSession's data chunks are read out of gRPC's
// slices without a protobuf copy. The wire format is the proto's.
class WorkerService final
    : public v1::Worker::WithRawCallbackMethod_OpenSession<
          v1::Worker::WithRawCallbackMethod_Prefill<
              v1::Worker::WithRawCallbackMethod_Decode<v1::Worker::WithRawCallbackMethod_EndRound<
                  v1::Worker::WithRawCallbackMethod_CloseSession<
                      v1::Worker::WithRawCallbackMethod_TransferSession<
                          v1::Worker::WithRawCallbackMethod_SendSession<
                              v1::Worker::WithRawCallbackMethod_PutSkew<
                                  v1::Worker::WithRawCallbackMethod_HeldRounds<
                                      v1::Worker::Service>>>>>>>>> {
 public:
  // `replicas`, when set, is the engine's store: sessions opened with
  // store_addresses keep their rounds on those stores. `peers`, when set,
  // are the only hand-off targets taken (others: PERMISSION_DENIED).
  WorkerService(worker::Engine* engine, const Authenticator* auth, WorkerMetrics* metrics,
                Executor* compute, Executor* io, WorkerServiceOptions options = {},
                ReplicatedSegments* replicas = nullptr, ControllerPolicies* policies = nullptr,
                KnownNodes* peers = nullptr);
  // Stops the idle-upload watchdog. Shut the server down first.
  ~WorkerService() override;

  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* req,
                                        grpc::ByteBuffer* resp) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Prefill(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Decode(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* EndRound(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                     grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const grpc::ByteBuffer* req,
                                         grpc::ByteBuffer* resp) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* TransferSession(grpc::CallbackServerContext* ctx,
                                                             grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* SendSession(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* req,
                                        grpc::ByteBuffer* resp) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* PutSkew(grpc::CallbackServerContext* ctx,
                                                     grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* HeldRounds(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* req,
                                       grpc::ByteBuffer* resp) override;

 private:
  class PrefillReactor;
  class DecodeReactor;
  class TransferReactor;
  class SkewReactor;

  // A sender of session `id` to the worker at `target` (transfer_service.cc),
  // authenticated with the caller's own credentials, bounded by its deadline
  // (or the store deadline when it set none).
  // PERMISSION_DENIED (or the controller's error) when `target` is not a
  // known peer; nothing is dialled then.
  absl::StatusOr<std::unique_ptr<SessionSender>> NewSender(const grpc::CallbackServerContext& ctx,
                                                           const worker::SessionKey& id,
                                                           const std::string& target);
  std::shared_ptr<grpc::Channel> PeerChannel(const std::string& target);
  // Drops a session that now lives on another worker (no store calls).
  void ForgetMoved(const worker::SessionKey& id);
  absl::Status DoSendSession(grpc::CallbackServerContext& ctx, const v1::SendSessionRequest& req,
                             v1::SendSessionResponse* resp);
  absl::Status DoHeldRounds(grpc::CallbackServerContext& ctx, const v1::HeldRoundsRequest& req,
                            v1::HeldRoundsResponse* resp);

  // A unary call on the io executor: parses `raw`, runs `work`, serializes
  // its response into `out`, and finishes.
  template <typename Req, typename Resp>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw,
                                  grpc::ByteBuffer* out, const char* method,
                                  absl::Status (WorkerService::*work)(grpc::CallbackServerContext&,
                                                                      const Req&, Resp*));
  absl::Status DoOpenSession(grpc::CallbackServerContext& ctx, const v1::OpenSessionRequest& req,
                             v1::OpenSessionResponse* resp);
  absl::Status DoEndRound(grpc::CallbackServerContext& ctx, const v1::EndRoundRequest& req,
                          v1::EndRoundResponse* resp);
  absl::Status DoCloseSession(grpc::CallbackServerContext& ctx, const v1::CloseSessionRequest& req,
                              v1::CloseSessionResponse* resp);

  // The engine's key for a caller's session: tenant-scoped. UNAUTHENTICATED,
  // PERMISSION_DENIED, INVALID_ARGUMENT for a malformed id.
  absl::StatusOr<worker::SessionKey> Key(const grpc::CallbackServerContext& ctx,
                                         const std::string& session) const;
  // The store calls' options for an RPC: its caller's deadline, or ours.
  CallOptions StoreCall(const grpc::CallbackServerContext& ctx) const;
  void UpdateWorkingSet();
  grpc::Status Done(const char* method, const absl::Status& s);

  worker::Engine* engine_;
  worker::SessionTransfer transfer_;  // Over engine_.
  const Authenticator* auth_;
  WorkerMetrics* metrics_;
  Executor* compute_;
  Executor* io_;
  const WorkerServiceOptions options_;
  ReplicatedSegments* const replicas_;  // May be null.
  // Null outside a cluster: a session opened without a Policy then runs
  // the defaults.
  ControllerPolicies* const policies_;
  KnownNodes* const known_peers_;  // May be null: any target.
  // PutSkew streams open, by caller tenant, and the watchdog that ends idle
  // ones (skew_upload_idle).
  absl::Status AdmitSkewUpload(SkewReactor* r, const std::string& caller);
  absl::Status ChargeSkewBytes(const std::string& caller, uint64_t bytes);
  void EndSkewUpload(SkewReactor* r, const std::string& caller, uint64_t bytes);
  void WatchIdleSkewUploads();
  struct SkewUploads {
    int open = 0;
    uint64_t bytes = 0;
  };
  absl::Mutex skew_mu_;
  std::map<std::string, SkewUploads> skew_uploads_ ABSL_GUARDED_BY(skew_mu_);
  std::set<SkewReactor*> skew_reactors_ ABSL_GUARDED_BY(skew_mu_);
  absl::Notification stop_;
  std::thread skew_watchdog_;
  // One channel per peer worker that sessions are handed to.
  absl::Mutex peers_mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> peers_ ABSL_GUARDED_BY(peers_mu_);
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_WORKER_WORKER_SERVICE_H_
