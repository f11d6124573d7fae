#include "rpc/transport_args.h"

#include <utility>

#include "grpc/grpc.h"

namespace kvtier {
namespace {

// Values measured with kvtier-bench store (docs/benchmarks.md).
constexpr std::pair<const char*, int> kArgs[] = {
    {GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 4 << 20},
    {GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 20},
};

}  // namespace

void ApplyBulkTransportArgs(grpc::ChannelArguments* args) {
  for (const auto& [k, v] : kArgs) args->SetInt(k, v);
}

void ApplyBulkTransportArgs(grpc::ServerBuilder* builder) {
  for (const auto& [k, v] : kArgs) builder->AddChannelArgument(k, v);
}

void ApplyReconnectArgs(grpc::ChannelArguments* args) {
  args->SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args->SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args->SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
}

std::shared_ptr<grpc::ChannelCredentials> ClientChannelCredentials(const ClientTls& tls,
                                                                   grpc::ChannelArguments* args) {
  if (tls.root_certs.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = tls.root_certs;
  ssl.pem_cert_chain = tls.cert_chain;
  ssl.pem_private_key = tls.private_key;
  if (!tls.server_name.empty()) args->SetSslTargetNameOverride(tls.server_name);
  return grpc::SslCredentials(ssl);
}

std::shared_ptr<grpc::ChannelCredentials> ClientChannelCredentials(const std::string& root_certs,
                                                                   const std::string& server_name,
                                                                   grpc::ChannelArguments* args) {
  return ClientChannelCredentials(ClientTls{root_certs, server_name, "", ""}, args);
}

}  // namespace kvtier
