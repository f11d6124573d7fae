#include "base/command_line.h"

#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/version.h"

namespace kvtier {
namespace {

// The project's root as this file was compiled: "<root>/base/command_line.cc"
// (CMake compiles every source by its absolute path).
absl::string_view ProjectRoot() {
  const absl::string_view kSelf = "base/command_line.cc";
  absl::string_view file = __FILE__;
  if (absl::EndsWith(file, kSelf)) file.remove_suffix(kSelf.size());
  return file;
}

bool IsOwnSource(absl::string_view filename) {
  const absl::string_view root = ProjectRoot();
  return !root.empty() && absl::StartsWith(filename, root);
}

// absl passes the normalized name: a project path is relative by then.
bool IsOwnFlag(absl::string_view filename) {
  return IsOwnSource(filename) ||
         (!absl::StartsWith(filename, "/") && !absl::StrContains(filename, "absl/"));
}

std::string Normalize(absl::string_view filename) {
  if (IsOwnSource(filename)) filename.remove_prefix(ProjectRoot().size());
  return std::string(filename);
}

}  // namespace

std::vector<char*> ParseKvtierCommandLine(int argc, char** argv, const char* usage) {
  absl::FlagsUsageConfig config;
  // absl's own --version prints the program's name and whether absl itself
  // was built without NDEBUG (Debian's is: "Debug build"), not kvtier's.
  absl::string_view program = argc > 0 ? argv[0] : "kvtier";
  if (const size_t slash = program.rfind('/'); slash != absl::string_view::npos) {
    program.remove_prefix(slash + 1);
  }
  config.version_string = [name = std::string(program)] {
    return absl::StrCat(name, " ", KvtierVersion(), "\n");
  };
  config.contains_help_flags = IsOwnFlag;
  config.contains_helpshort_flags = IsOwnFlag;
  config.normalize_filename = Normalize;
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(usage);
  // absl's own handling exits 1 after --help; asking for help is not a
  // failure, so it is handled here and exits 0 (as --version does).
  std::vector<char*> rest = absl::flags_internal::ParseCommandLineImpl(
      argc, argv, absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
      absl::flags_internal::UsageFlagsAction::kIgnoreUsage,
      absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  const int usage_exit = absl::flags_internal::HandleUsageFlags(std::cout, usage);
  if (usage_exit >= 0) {
    std::cout.flush();
    std::exit(0);
  }
  return rest;
}

}  // namespace kvtier
