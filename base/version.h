// kvtier's version and build type, as CMake configured them: what `--version`,
// the kvtier_build_info metric and kvtier.__version__ report.
#ifndef KVTIER_BASE_VERSION_H_
#define KVTIER_BASE_VERSION_H_

#include <string>

namespace kvtier {

// CMake's PROJECT_VERSION, e.g. "0.1.0".
const char* KvtierVersionNumber();
// CMAKE_BUILD_TYPE ("default" when none was set).
const char* KvtierBuildType();
// "VERSION (BUILD_TYPE build)".
std::string KvtierVersion();

}  // namespace kvtier

#endif  // KVTIER_BASE_VERSION_H_
