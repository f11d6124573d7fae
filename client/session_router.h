// The engine side of a kvtier cluster: where each session lives, and where
// it goes when its worker cannot be reached. An engine routes a session
// once (kvtier-controller's Route, with the engine's tenant token), opens it
// on the answer's worker with the answer's store replicas, and keeps the
// route. When the worker fails a call with UNAVAILABLE or DEADLINE_EXCEEDED,
// Failover asks the controller for a new home avoiding that worker (the
// session moves at once; nothing waits for the worker's lease), and the
// engine resumes the session there (OpenSession with resume) and re-sends
// only its open round. refengine's ClusterSession does all of this for
// kvtier-engine.
#ifndef KVTIER_CLIENT_SESSION_ROUTER_H_
#define KVTIER_CLIENT_SESSION_ROUTER_H_

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/controller_client.h"
#include "grpcpp/channel.h"

namespace kvtier {

// True for the failures that a move to another worker can cure: the worker
// is gone (UNAVAILABLE) or stopped answering (DEADLINE_EXCEEDED), or the
// stream broke under it (CANCELLED, ABORTED, INTERNAL from a reset stream).
bool WorkerFailoverCandidate(const absl::Status& s);

// How the router's channels reach workers.
struct WorkerChannelOptions {
  // PEM of the CA that signed the workers' certificates; empty = plaintext.
  std::string tls_root_certs;
  // The name expected in their certificates, instead of the address's host.
  std::string tls_server_name;
  // PEM of the engine's own certificate chain and key, for workers that
  // require client certificates (mutual TLS); empty: none presented.
  std::string tls_cert_chain = {}, tls_private_key = {};
};

// Thread-safe: one router serves every session of an engine.
class SessionRouter {
 public:
  // `controller.token` is the engine's tenant token. INVALID_ARGUMENT
  // without a target.
  static absl::StatusOr<std::unique_ptr<SessionRouter>> Connect(ControllerClientOptions controller,
                                                                WorkerChannelOptions workers = {});

  // Where `session` lives: the cached route, or the controller's answer.
  absl::StatusOr<v1::RouteResponse> Route(const std::string& session, const CallOptions& call = {});
  // The session's worker (`failed`, a route this router gave) could not be
  // reached: asks again avoiding that worker, and caches the answer.
  // UNAVAILABLE when no other worker is live.
  absl::StatusOr<v1::RouteResponse> Failover(const std::string& session,
                                             const v1::RouteResponse& failed,
                                             const CallOptions& call = {});
  // The session's decode worker (`failed.decode_worker_node_id()`, a route
  // this router gave) could not be reached: asks again avoiding it, so that
  // another decode-role worker takes the decode steps, or none (the session's
  // own worker decodes). The session's worker and stores stay. Caches the
  // answer.
  absl::StatusOr<v1::RouteResponse> FailoverDecode(const std::string& session,
                                                   const v1::RouteResponse& failed,
                                                   const CallOptions& call = {});
  // Asks the controller again (its replicas may have changed since: a dead
  // store is replaced without the engine noticing) and caches the answer.
  absl::StatusOr<v1::RouteResponse> Refresh(const std::string& session,
                                            const CallOptions& call = {});
  void Forget(const std::string& session);

  // One channel per worker address, shared by every session on it.
  std::shared_ptr<grpc::Channel> Channel(const std::string& address);

  uint64_t failovers() const;

  // Whether the server at `address` answers a health check within
  // `timeout`: tells a worker that is gone or stopped (false) from one that
  // failed a call because of something behind it, such as a store (true).
  bool Answers(const std::string& address, absl::Duration timeout);

 private:
  SessionRouter(std::unique_ptr<ControllerClient> client, WorkerChannelOptions workers)
      : client_(std::move(client)), workers_(std::move(workers)) {}

  std::unique_ptr<ControllerClient> client_;
  const WorkerChannelOptions workers_;
  mutable absl::Mutex mu_;
  std::map<std::string, v1::RouteResponse> routes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  uint64_t failovers_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_SESSION_ROUTER_H_
