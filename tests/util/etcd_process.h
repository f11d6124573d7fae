// A real etcd (Debian's etcd-server package) for tests of the controller's
// etcd back end: one member, started on an address the test gives (and,
// for network namespaces, through a command prefix such as `ip netns exec
// NS`), killed and its data removed on destruction.
#ifndef KVTIER_TESTS_UTIL_ETCD_PROCESS_H_
#define KVTIER_TESTS_UTIL_ETCD_PROCESS_H_

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "services/controller/etcd_client.h"
#include "testing/store_process.h"

namespace kvtier::testing {

class EtcdProcess {
 public:
  // The etcd binary ($KVTIER_ETCD_BINARY, else /usr/bin/etcd), or empty when
  // it is not installed (scripts/kvtier.sh installs etcd-server).
  static std::string Binary() {
    if (const char* env = std::getenv("KVTIER_ETCD_BINARY")) return env;
    return ::access("/usr/bin/etcd", X_OK) == 0 ? "/usr/bin/etcd" : "";
  }

  // `client_port` and `peer_port` 0: free ports of the root namespace.
  EtcdProcess(std::string dir, std::string host = "127.0.0.1",
              std::vector<std::string> exec_prefix = {}, int client_port = 0, int peer_port = 0)
      : dir_(std::move(dir)),
        host_(std::move(host)),
        prefix_(std::move(exec_prefix)),
        client_port_(client_port == 0 ? FreePort() : client_port),
        peer_port_(peer_port == 0 ? FreePort() : peer_port) {}
  ~EtcdProcess() { Kill(); }

  // Starts it and waits (up to 30 s) until its JSON gateway answers.
  absl::Status Start() {
    const std::string client = endpoint();
    const std::string peer = absl::StrCat("http://", host_, ":", peer_port_);
    std::vector<std::string> argv = prefix_;
    for (const std::string& a :
         {Binary(), std::string("--name=kvt"), "--data-dir=" + dir_ + "/etcd-data",
          "--listen-client-urls=" + client, "--advertise-client-urls=" + client,
          "--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
          "--initial-cluster=kvt=" + peer, std::string("--initial-cluster-state=new")}) {
      argv.push_back(a);
    }
    pid_ = SpawnLogged(argv, dir_ + "/etcd.log");
    if (pid_ < 0) return absl::InternalError("fork failed");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    absl::Status last;
    while (std::chrono::steady_clock::now() < deadline) {
      int status;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return absl::InternalError("etcd exited at start; see " + dir_ + "/etcd.log");
      }
      EtcdOptions o;
      o.endpoints = {client};
      o.timeout = absl::Milliseconds(500);
      auto c = EtcdClient::Connect(o);
      if (c.ok()) return absl::OkStatus();
      last = c.status();
      // Polling a server that is starting; not a synchronization sleep.
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    Kill();
    return absl::InternalError(absl::StrCat("etcd did not answer: ", last.ToString()));
  }
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }
  std::string endpoint() const { return absl::StrCat("http://", host_, ":", client_port_); }

 private:
  static int FreePort() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    int port = 0;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      port = ntohs(a.sin_port);
    }
    ::close(fd);
    return port;
  }

  std::string dir_, host_;
  std::vector<std::string> prefix_;
  int client_port_, peer_port_;
  pid_t pid_ = -1;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_UTIL_ETCD_PROCESS_H_
