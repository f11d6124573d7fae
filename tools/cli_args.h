// Minimal "--key=value" parsing for the kvtier CLI's subcommands.
#ifndef KVTIER_TOOLS_CLI_ARGS_H_
#define KVTIER_TOOLS_CLI_ARGS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvtier::cli {

class Args {
 public:
  // Parses argv[first..]: "--k=v", "--k v", and the boolean flags "--unpin",
  // "--oracle" and "--help" (value "true"). Anything else is a positional argument.
  Args(int argc, char** argv, int first);

  bool Has(const std::string& k) const { return kv_.count(k) != 0; }
  std::string Get(const std::string& k, const std::string& def = "") const;
  // Exits with a message when the value is not a non-negative integer.
  uint64_t GetU64(const std::string& k, uint64_t def) const;
  const std::vector<std::string>& positional() const { return pos_; }
  // Names of flags not in `known`, for a clear error.
  std::vector<std::string> Unknown(const std::vector<std::string>& known) const;

 private:
  std::map<std::string, std::string> kv_;
  std::vector<std::string> pos_;
};

// The TLS flags of a subcommand that reaches a server: --tls_ca=FILE (PEM
// roots: use TLS and verify the server), and for servers that require
// client certificates --tls_cert=FILE and --tls_key=FILE (this client's
// PEM chain and key). Fills the files' contents; false with *error set when
// one cannot be read, or only one of --tls_cert and --tls_key is given.
bool ReadClientTls(const Args& args, std::string* root_certs, std::string* cert_chain,
                   std::string* private_key, std::string* error);

}  // namespace kvtier::cli

#endif  // KVTIER_TOOLS_CLI_ARGS_H_
