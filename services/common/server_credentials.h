// Server and channel credentials: TLS when cert/key files are given,
// plaintext otherwise.
#ifndef KVTIER_SERVICES_COMMON_SERVER_CREDENTIALS_H_
#define KVTIER_SERVICES_COMMON_SERVER_CREDENTIALS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"

namespace kvtier {

// TLS from PEM files when both paths are set; INVALID_ARGUMENT when only one
// is; NOT_FOUND when a file cannot be read; insecure when neither is set.
// With `client_ca_path`, mutual TLS: every client must present a
// certificate that CA signed, or its handshake fails (INVALID_ARGUMENT when
// it is given without TLS).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& cert_path, const std::string& key_path,
    const std::string& client_ca_path = "");

// Reads a whole file. NOT_FOUND when it cannot be read.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_SERVER_CREDENTIALS_H_
