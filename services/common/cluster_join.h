// How a kvtier-store or kvtier-worker joins a cluster: with --controller set
// it runs a NodeAgent (client/controller_client.h) that registers the node
// and keeps its lease.
#ifndef KVTIER_SERVICES_COMMON_CLUSTER_JOIN_H_
#define KVTIER_SERVICES_COMMON_CLUSTER_JOIN_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/controller_client.h"

namespace kvtier {

struct ClusterOptions {
  // kvtier-controller's host:port; empty: not in a cluster.
  std::string controller;
  // The node token for the controller; empty sends none.
  std::string controller_token;
  // This node's id; empty: its advertised address.
  std::string node_id;
  // host:port others reach this node at; empty: the listen address with the
  // bound port (which must then name a specific host, not 0.0.0.0 or [::]).
  std::string advertise;
  // TLS to the controller: PEM of its CA (empty: plaintext), and this
  // node's own certificate chain and key for a controller that requires
  // client certificates (mutual TLS; the certificate may then stand for
  // the node token).
  std::string controller_tls_root_certs;
  std::string tls_cert_chain, tls_private_key;
};

// The controller client options of a node in `cluster`.
ControllerClientOptions ControllerOptionsOf(const ClusterOptions& cluster);

// What the node tells the agent, and hears from it (NodeAgentOptions).
struct NodeHooks {
  std::function<NodeUsage()> usage;
  // Workers: the sessions the node holds, reported at each registration.
  std::function<std::vector<v1::HeldSession>()> sessions;
  // When set, receives the placement epoch the agent hears.
  std::shared_ptr<std::atomic<uint64_t>> epoch;
  // Each heartbeat answer (pressure level, cold threshold), on the agent's
  // thread: must not block.
  std::function<void(const v1::HeartbeatResponse&)> on_heartbeat;
  // Workers: the role registered (kvtier-worker --role).
  v1::WorkerRole role = v1::WORKER_ROLE_BOTH;
};

// Starts the agent, or returns null when `cluster.controller` is empty.
// INVALID_ARGUMENT when the address to advertise cannot be known.
absl::StatusOr<std::unique_ptr<NodeAgent>> JoinCluster(const ClusterOptions& cluster,
                                                       v1::NodeKind kind, const std::string& listen,
                                                       int bound_port, uint64_t capacity_bytes,
                                                       NodeHooks hooks);

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_CLUSTER_JOIN_H_
