// Runs a real kvtier-store process on 127.0.0.1 with port 0, for
// integration, crash and benchmark runs.
#ifndef KVTIER_TESTING_STORE_PROCESS_H_
#define KVTIER_TESTING_STORE_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace kvtier::testing {

// The kvtier-store binary: $KVTIER_STORE_BINARY, else the path baked in at
// build time.
std::string StoreBinary();

// Forks and runs argv[0] (looked up on PATH when it has no '/') with stdout
// and stderr appended to `log_path`. Returns the child's pid, or -1 when
// fork fails.
pid_t SpawnLogged(std::vector<std::string> argv, const std::string& log_path);

class StoreProcess {
 public:
  // `data_dir` is the RocksDB directory; `extra_flags` are passed through.
  StoreProcess(std::string data_dir, std::vector<std::string> extra_flags = {});
  ~StoreProcess();  // SIGKILLs a running process.

  // Starts it and waits (up to 30 s) until it serves. INTERNAL if it exits or
  // never writes its port file; the log tail is in the message.
  absl::Status Start();
  // SIGKILL and reap.
  void Kill();
  // SIGSTOP / SIGCONT: a store that accepts connections and never answers
  // (Pause returns once it has stopped).
  void Pause();
  void Resume();
  // SIGTERM, then wait for a clean exit. Returns the exit status.
  int Stop();

  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  const std::string& log_path() const { return log_path_; }

 private:
  std::string data_dir_;
  std::vector<std::string> flags_;
  std::string log_path_;
  pid_t pid_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTING_STORE_PROCESS_H_
