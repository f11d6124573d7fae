#include "services/common/cluster_flags.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, controller, "",
          "kvtier-controller host:port to register with and heartbeat; empty: standalone.");
ABSL_FLAG(std::string, controller_token, "", "Node token for --controller.");
ABSL_FLAG(std::string, node_id, "", "This node's id in the cluster; empty: its --advertise.");
ABSL_FLAG(std::string, advertise, "",
          "host:port the cluster reaches this node at; empty: --listen's host and bound port.");

ABSL_FLAG(std::string, controller_tls_root_certs, "",
          "PEM file of the CA of --controller's certificate; empty: plaintext.");
ABSL_FLAG(
    std::string, tls_client_cert, "",
    "PEM certificate chain this node presents to servers that require client "
    "certificates (mutual TLS: --controller, and a worker's --store); with --tls_client_key.");
ABSL_FLAG(std::string, tls_client_key, "", "PEM private key of --tls_client_cert.");

namespace kvtier {
namespace {

std::string ReadOrEmpty(const std::string& path) {
  if (path.empty()) return "";
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    std::exit(2);
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

ClusterOptions ClusterOptionsFromFlags() {
  ClusterOptions o;
  o.controller_tls_root_certs = ReadOrEmpty(absl::GetFlag(FLAGS_controller_tls_root_certs));
  if (absl::GetFlag(FLAGS_tls_client_cert).empty() != absl::GetFlag(FLAGS_tls_client_key).empty()) {
    std::fprintf(stderr, "--tls_client_cert and --tls_client_key go together\n");
    std::exit(2);
  }
  o.tls_cert_chain = ReadOrEmpty(absl::GetFlag(FLAGS_tls_client_cert));
  o.tls_private_key = ReadOrEmpty(absl::GetFlag(FLAGS_tls_client_key));
  o.controller = absl::GetFlag(FLAGS_controller);
  o.controller_token = absl::GetFlag(FLAGS_controller_token);
  o.node_id = absl::GetFlag(FLAGS_node_id);
  o.advertise = absl::GetFlag(FLAGS_advertise);
  return o;
}

}  // namespace kvtier
