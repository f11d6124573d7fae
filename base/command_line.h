// The command line of kvtier's binaries: usage text, `--help` that lists the
// binary's own flags with their defaults, and parsing.
#ifndef KVTIER_BASE_COMMAND_LINE_H_
#define KVTIER_BASE_COMMAND_LINE_H_

#include <vector>

namespace kvtier {

// Sets `usage` as the program's usage message and makes `--help` (and
// `--helpshort`) list every flag defined in kvtier's own sources, with
// source paths relative to the project (absl's and gRPC's own flags stay
// under `--helpfull`); then parses the command line as
// absl::ParseCommandLine does (an unknown or malformed flag prints one line
// naming it and exits 1). Returns the positional arguments, argv[0] first.
// `--version` prints "PROGRAM VERSION (BUILD_TYPE build)", PROGRAM being
// argv[0]'s last path component. Asking for help (`--help` and the other
// usage flags) or the version prints it and exits 0.
std::vector<char*> ParseKvtierCommandLine(int argc, char** argv, const char* usage);

}  // namespace kvtier

#endif  // KVTIER_BASE_COMMAND_LINE_H_
