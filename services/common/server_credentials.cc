#include "services/common/server_credentials.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace kvtier {

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& cert_path, const std::string& key_path, const std::string& client_ca_path) {
  if (cert_path.empty() && key_path.empty()) {
    if (!client_ca_path.empty()) {
      return absl::InvalidArgumentError("--tls_client_ca needs TLS (--tls_cert and --tls_key)");
    }
    return grpc::InsecureServerCredentials();
  }
  if (cert_path.empty() || key_path.empty()) {
    return absl::InvalidArgumentError("TLS needs both --tls_cert and --tls_key");
  }
  KVT_ASSIGN_OR_RETURN(std::string cert, ReadFileToString(cert_path));
  KVT_ASSIGN_OR_RETURN(std::string key, ReadFileToString(key_path));
  grpc::SslServerCredentialsOptions opts(
      client_ca_path.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                             : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  opts.pem_key_cert_pairs.push_back({key, cert});
  if (!client_ca_path.empty()) {
    KVT_ASSIGN_OR_RETURN(opts.pem_root_certs, ReadFileToString(client_ca_path));
    if (opts.pem_root_certs.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls_client_ca ", client_ca_path, " is empty"));
    }
  }
  return grpc::SslServerCredentials(opts);
}

}  // namespace kvtier
