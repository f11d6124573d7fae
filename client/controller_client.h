// The client side of kvtier-controller: a thin Controller client, and the
// node agent that every kvtier-store and kvtier-worker started with
// --controller runs to register and keep its lease.
#ifndef KVTIER_CLIENT_CONTROLLER_CLIENT_H_
#define KVTIER_CLIENT_CONTROLLER_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "base/call_options.h"
#include "kvtier/v1/controller.grpc.pb.h"

namespace kvtier {

struct ControllerClientOptions {
  // "host:port" of kvtier-controller, or several replicas' (etcd back end)
  // separated by commas: a call that finds one UNAVAILABLE or past its
  // share of the deadline goes on to the next, and the one that answered is
  // tried first next time. Required.
  std::string target;
  // Bearer token (a node token for Register/Heartbeat); empty sends none.
  std::string token;
  // PEM roots to verify the controller; empty = plaintext.
  std::string tls_root_certs;
  // Expected in the controller's certificate instead of the target's host.
  std::string tls_server_name;
  // PEM of this client's certificate chain and key, for a controller that
  // requires one (--tls_client_ca); empty: none presented.
  std::string tls_cert_chain, tls_private_key;
  // Deadline of a call whose CallOptions set none. Default: 2 s.
  absl::Duration deadline = absl::Seconds(2);
};

// Thread-safe.
class ControllerClient {
 public:
  static absl::StatusOr<std::unique_ptr<ControllerClient>> Connect(ControllerClientOptions options);

  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& req,
                                                const CallOptions& call = {});
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& req,
                                                  const CallOptions& call = {});
  absl::StatusOr<v1::RouteResponse> Route(const v1::RouteRequest& req,
                                          const CallOptions& call = {});
  absl::StatusOr<v1::ListNodesResponse> ListNodes(const CallOptions& call = {});
  absl::StatusOr<v1::GetPolicyResponse> GetPolicy(const v1::GetPolicyRequest& req,
                                                  const CallOptions& call = {});
  absl::StatusOr<v1::SetPolicyResponse> SetPolicy(const v1::SetPolicyRequest& req,
                                                  const CallOptions& call = {});

 private:
  explicit ControllerClient(ControllerClientOptions options);
  std::unique_ptr<grpc::ClientContext> NewContext(const CallOptions& call) const;
  // Runs fn(stub, context, response) on the replicas in turn (see target).
  template <typename Resp, typename Fn>
  absl::StatusOr<Resp> Call(const CallOptions& call, Fn fn);

  const ControllerClientOptions options_;
  std::vector<std::unique_ptr<v1::Controller::Stub>> stubs_;
  std::atomic<size_t> current_{0};
};

struct NodeUsage {
  uint64_t used_bytes = 0;
  uint32_t active_sessions = 0;
};

struct NodeAgentOptions {
  ControllerClientOptions controller;
  v1::RegisterRequest node;  // id, kind, address to advertise, capacity.
  // Called before each heartbeat; may be empty (reports zeros).
  std::function<NodeUsage()> usage;
  // Called before each registration: the sessions a worker holds
  // (RegisterRequest.sessions); may be empty.
  std::function<std::vector<v1::HeldSession>()> sessions;
  // When set, also receives every placement epoch the agent hears.
  std::shared_ptr<std::atomic<uint64_t>> epoch_sink;
  // When set, called with each heartbeat answer on the agent's thread; must
  // not block.
  std::function<void(const v1::HeartbeatResponse&)> on_heartbeat;
};

// Registers the node and sends its heartbeats from a thread of its own, at
// the interval the controller answers. A controller that cannot be reached
// is retried every interval (logged once per outage); a heartbeat answered
// NOT_FOUND (the node was declared dead, or the controller restarted and
// forgot it) registers again. Stops on destruction.
class NodeAgent {
 public:
  static absl::StatusOr<std::unique_ptr<NodeAgent>> Start(NodeAgentOptions options);
  ~NodeAgent();

  // True once a registration succeeded (and until a heartbeat is refused).
  bool registered() const { return registered_.load(); }
  const std::string& node_id() const { return options_.node.node_id(); }
  uint64_t epoch() const { return epoch_.load(); }

 private:
  explicit NodeAgent(NodeAgentOptions options) : options_(std::move(options)) {}
  void Run();

  const NodeAgentOptions options_;
  std::unique_ptr<ControllerClient> client_;
  std::atomic<bool> registered_{false};
  std::atomic<uint64_t> epoch_{0};
  void NoteEpoch(uint64_t e) {
    epoch_.store(e);
    if (options_.epoch_sink != nullptr) options_.epoch_sink->store(e);
  }
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_CONTROLLER_CLIENT_H_
