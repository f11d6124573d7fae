// A small client of etcd's v3 API through its JSON gateway (HTTP POST to
// /v3/kv/*, /v3/lease/*), enough for kvtier-controller's etcd back end:
// keys with leases, prefix ranges, create-if-absent and compare-and-put.
// Keys and values are bytes (the gateway carries them base64-encoded).
//
// Endpoints are tried in order; a call that cannot reach one (connection
// refused, timeout, HTTP 5xx) moves on to the next, and the last reachable
// one is tried first next time.
#ifndef KVTIER_SERVICES_CONTROLLER_ETCD_CLIENT_H_
#define KVTIER_SERVICES_CONTROLLER_ETCD_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvtier {

struct EtcdOptions {
  // "http://host:port" of etcd members (the client URLs). Required.
  std::vector<std::string> endpoints;
  // Per HTTP request. Default: 2 s.
  absl::Duration timeout = absl::Seconds(2);
};

struct EtcdKeyValue {
  std::string key, value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

// Thread-safe.
class EtcdClient {
 public:
  // INVALID_ARGUMENT without endpoints; UNAVAILABLE when none answers
  // (checked with a range of one key).
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Connect(EtcdOptions options);

  // A lease of `ttl` (etcd rounds up to whole seconds and to its minimum).
  absl::StatusOr<int64_t> Grant(absl::Duration ttl);
  // NOT_FOUND when the lease expired (or never existed).
  absl::Status KeepAlive(int64_t lease);
  absl::Status Revoke(int64_t lease);

  // lease 0: none. Returns the store's revision after the put.
  absl::StatusOr<int64_t> Put(const std::string& key, const std::string& value, int64_t lease = 0);
  absl::StatusOr<std::optional<EtcdKeyValue>> Get(const std::string& key);
  // Every key that starts with `prefix`, by key.
  absl::StatusOr<std::vector<EtcdKeyValue>> GetPrefix(const std::string& prefix);
  absl::Status Delete(const std::string& key);
  // Puts key only while its mod revision is `expected_mod_revision` (0: the
  // key is absent). True when it was put; false when another writer got
  // there first (read it again).
  absl::StatusOr<bool> CompareAndPut(const std::string& key, const std::string& value,
                                     int64_t expected_mod_revision, int64_t lease = 0);

 private:
  explicit EtcdClient(EtcdOptions options) : options_(std::move(options)) {}
  // POSTs `json` to `path` on the first endpoint that answers; the
  // response body. UNAVAILABLE when none does; the gateway's error (mapped
  // from its gRPC code) otherwise.
  absl::StatusOr<std::string> Post(const std::string& path, const std::string& json);

  const EtcdOptions options_;
  std::atomic<size_t> preferred_{0};
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_CONTROLLER_ETCD_CLIENT_H_
