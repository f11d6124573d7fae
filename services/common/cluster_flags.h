// The flags with which kvtier-store and kvtier-worker join a cluster
// (--controller, --controller_token, --node_id, --advertise), defined once
// for both binaries.
#ifndef KVTIER_SERVICES_COMMON_CLUSTER_FLAGS_H_
#define KVTIER_SERVICES_COMMON_CLUSTER_FLAGS_H_

#include "services/common/cluster_join.h"

namespace kvtier {

// The parsed flags. Call after absl::ParseCommandLine.
ClusterOptions ClusterOptionsFromFlags();

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_CLUSTER_FLAGS_H_
