// The per-model policies an operator registers with kvtier-controller
// (SetPolicy, `kvtier policy set`), kept in a file so that a restarted
// controller serves them again, and the pressure tightening GetPolicy
// applies to cold sessions.
//
// File format (--state_dir/policies): the magic line "kvtier-policies 1\n",
// then per policy a 4-byte little-endian length and a serialized
// SetPolicyRequest, then the CRC-32C of everything before it (4 bytes,
// little-endian). Written to a temporary file, fsynced and renamed over the
// old one, so a crash leaves the old file or the new one, never a mix.
#ifndef KVTIER_SERVICES_CONTROLLER_POLICY_BOOK_H_
#define KVTIER_SERVICES_CONTROLLER_POLICY_BOOK_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvtier/v1/controller.pb.h"

namespace kvtier {

// Where policies live when controller replicas share them (the etcd back
// end): serialized SetPolicyRequests by model name.
struct PolicyRemote {
  std::function<absl::Status(const std::string& model, const std::string& bytes)> put;
  std::function<absl::StatusOr<std::optional<std::string>>(const std::string& model)> get;
};

// Thread-safe.
class PolicyBook {
 public:
  // Reads `path` when it exists; an empty path keeps policies in memory only.
  // DATA_LOSS for a file that fails its checksum or does not parse.
  static absl::StatusOr<std::unique_ptr<PolicyBook>> Open(std::string path);
  // Policies kept in `remote` (every replica sees every Set); the last
  // answer per model is cached for when the remote cannot be reached.
  static std::unique_ptr<PolicyBook> OpenShared(PolicyRemote remote);

  // Validates and records req (replacing the model's earlier policy), then
  // rewrites the file. Returns whether it replaced one; INVALID_ARGUMENT for
  // a policy a worker could not open a session with; INTERNAL when the file
  // cannot be written (nothing changes then).
  absl::StatusOr<bool> Set(const v1::SetPolicyRequest& req);
  std::optional<v1::SetPolicyRequest> Get(const std::string& model_name) const;
  size_t size() const;

 private:
  explicit PolicyBook(std::string path) : path_(std::move(path)) {}
  explicit PolicyBook(PolicyRemote remote) : remote_(std::move(remote)) {}
  absl::Status WriteLocked(const std::map<std::string, v1::SetPolicyRequest>& all) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const PolicyRemote remote_;  // Unset: the file (or memory).
  mutable absl::Mutex mu_;
  mutable std::map<std::string, v1::SetPolicyRequest> policies_ ABSL_GUARDED_BY(mu_);
};

// What GetPolicy answers for a registered policy: as registered, or, when
// `tighten`, with fewer bits (KIVI/KCVT/GEAR at more than 2 bits go to 2;
// raw goes to KIVI 4-bit) and half the eviction budgets (per-head budget
// and every layer budget, never below the observation window + 1).
v1::GetPolicyResponse AnswerPolicy(const v1::SetPolicyRequest& registered, bool tighten);

}  // namespace kvtier

#endif  // KVTIER_SERVICES_CONTROLLER_POLICY_BOOK_H_
