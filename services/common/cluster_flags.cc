#include "services/common/cluster_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, controller, "",
          "kvtier-controller host:port to register with and heartbeat; empty: standalone.");
ABSL_FLAG(std::string, controller_token, "", "Node token for --controller.");
ABSL_FLAG(std::string, node_id, "", "This node's id in the cluster; empty: its --advertise.");
ABSL_FLAG(std::string, advertise, "",
          "host:port the cluster reaches this node at; empty: --listen's host and bound port.");

namespace kvtier {

ClusterOptions ClusterOptionsFromFlags() {
  ClusterOptions o;
  o.controller = absl::GetFlag(FLAGS_controller);
  o.controller_token = absl::GetFlag(FLAGS_controller_token);
  o.node_id = absl::GetFlag(FLAGS_node_id);
  o.advertise = absl::GetFlag(FLAGS_advertise);
  return o;
}

}  // namespace kvtier
