// Writes a bound port to a file (atomically, through a rename), so that
// scripts and tests can find a server started with port 0.
#ifndef KVTIER_SERVICES_COMMON_PORT_FILE_H_
#define KVTIER_SERVICES_COMMON_PORT_FILE_H_

#include <cstdio>
#include <fstream>
#include <string>

namespace kvtier {

// True on success; an empty path writes nothing and succeeds.
inline bool WritePortFile(const std::string& path, int port) {
  if (path.empty()) return true;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    if (!out) return false;
    out << port << "\n";
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_PORT_FILE_H_
