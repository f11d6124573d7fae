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
    const std::string& cert_path, const std::string& key_path) {
  if (cert_path.empty() && key_path.empty()) return grpc::InsecureServerCredentials();
  if (cert_path.empty() || key_path.empty()) {
    return absl::InvalidArgumentError("TLS needs both --tls_cert and --tls_key");
  }
  KVT_ASSIGN_OR_RETURN(std::string cert, ReadFileToString(cert_path));
  KVT_ASSIGN_OR_RETURN(std::string key, ReadFileToString(key_path));
  grpc::SslServerCredentialsOptions opts;
  opts.pem_key_cert_pairs.push_back({key, cert});
  return grpc::SslServerCredentials(opts);
}

}  // namespace kvtier
