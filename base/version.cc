#include "base/version.h"

#include "absl/strings/str_cat.h"

namespace kvtier {

// KVTIER_VERSION and KVTIER_BUILD_TYPE are defined for this file alone
// (base/CMakeLists.txt), so that a new version recompiles nothing else.
const char* KvtierVersionNumber() { return KVTIER_VERSION; }
const char* KvtierBuildType() { return KVTIER_BUILD_TYPE; }

std::string KvtierVersion() {
  return absl::StrCat(KvtierVersionNumber(), " (", KvtierBuildType(), " build)");
}

}  // namespace kvtier
