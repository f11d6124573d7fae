// The end of a kvtier server's main(): start, publish the ports, run until
// SIGINT or SIGTERM, shut down.
#ifndef KVTIER_SERVICES_COMMON_SERVE_MAIN_H_
#define KVTIER_SERVICES_COMMON_SERVE_MAIN_H_

#include <pthread.h>
#include <signal.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "base/log.h"
#include "services/common/port_file.h"

namespace kvtier {

// Blocks SIGINT/SIGTERM in every thread (before `start` creates any), runs
// `start`, writes the gRPC and metrics ports to their files (empty paths
// write nothing), then waits for a signal and destroys the server. Returns
// the process exit code. Server needs port() and metrics_port().
template <typename Server>
int ServeUntilSignal(const std::string& name,
                     const std::function<absl::StatusOr<std::unique_ptr<Server>>()>& start,
                     const std::string& port_file, const std::string& metrics_port_file) {
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  absl::StatusOr<std::unique_ptr<Server>> server = start();
  if (!server.ok()) {
    LogError(name + " failed to start", {{"error", server.status().ToString()}});
    return 1;
  }
  if (!WritePortFile(port_file, (*server)->port()) ||
      !WritePortFile(metrics_port_file, (*server)->metrics_port())) {
    LogError("cannot write port file");
    return 1;
  }
  int sig = 0;
  sigwait(&sigs, &sig);
  LogInfo(name + " shutting down", {{"signal", sig}});
  server->reset();
  LogInfo(name + " stopped");
  return 0;
}

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_SERVE_MAIN_H_
