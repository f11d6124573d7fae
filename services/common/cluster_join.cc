#include "services/common/cluster_join.h"

#include "absl/strings/str_cat.h"

namespace kvtier {

ControllerClientOptions ControllerOptionsOf(const ClusterOptions& cluster) {
  ControllerClientOptions o;
  o.target = cluster.controller;
  o.token = cluster.controller_token;
  o.tls_root_certs = cluster.controller_tls_root_certs;
  o.tls_cert_chain = cluster.tls_cert_chain;
  o.tls_private_key = cluster.tls_private_key;
  return o;
}

absl::StatusOr<std::unique_ptr<NodeAgent>> JoinCluster(const ClusterOptions& cluster,
                                                       v1::NodeKind kind, const std::string& listen,
                                                       int bound_port, uint64_t capacity_bytes,
                                                       NodeHooks hooks) {
  if (cluster.controller.empty()) return std::unique_ptr<NodeAgent>();
  std::string advertise = cluster.advertise;
  if (advertise.empty()) {
    const size_t colon = listen.rfind(':');
    const std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
    if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::") {
      return absl::InvalidArgumentError(
          absl::StrCat("listening on ", listen,
                       ": give --advertise=HOST:PORT, the address the cluster "
                       "reaches this node at"));
    }
    advertise = absl::StrCat(host, ":", bound_port);
  }
  NodeAgentOptions o;
  o.controller = ControllerOptionsOf(cluster);
  o.node.set_node_id(cluster.node_id.empty() ? advertise : cluster.node_id);
  o.node.set_kind(kind);
  o.node.set_address(advertise);
  o.node.set_capacity_bytes(capacity_bytes);
  o.node.set_role(hooks.role);
  o.usage = std::move(hooks.usage);
  o.sessions = std::move(hooks.sessions);
  o.epoch_sink = std::move(hooks.epoch);
  o.on_heartbeat = std::move(hooks.on_heartbeat);
  return NodeAgent::Start(std::move(o));
}

}  // namespace kvtier
