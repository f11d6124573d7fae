// What the files of Store (store.cc, store_write.cc, store_removal.cc,
// store_read.cc, store_check.cc) share and nothing else includes: the
// conversion of RocksDB's status and the missing-session error.
#ifndef KVTIER_CACHESTORE_STORE_INTERNAL_H_
#define KVTIER_CACHESTORE_STORE_INTERNAL_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "rocksdb/status.h"

namespace kvtier::cachestore::detail {

// RocksDB's status as the store reports it: NOT_FOUND, DATA_LOSS for
// corruption, INTERNAL otherwise, with `what` in front.
inline absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  if (s.IsNotFound()) return absl::NotFoundError(absl::StrCat(what, ": not found"));
  if (s.IsCorruption()) return absl::DataLossError(absl::StrCat(what, ": ", s.ToString()));
  return absl::InternalError(absl::StrCat(what, ": ", s.ToString()));
}

inline absl::Status NoSession(const std::string& session) {
  return absl::NotFoundError(absl::StrCat("session '", session, "' not found"));
}

}  // namespace kvtier::cachestore::detail

#endif  // KVTIER_CACHESTORE_STORE_INTERNAL_H_
