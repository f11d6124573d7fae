// Hosts on one machine for cluster tests: each host is a network namespace
// with its own address, joined to the test (in the root namespace) by a
// veth pair on a bridge the harness creates; kvtier processes run inside
// them through `ip netns exec`. Everything is removed on destruction.
// Needs root and iproute2: NetnsCluster::Create says why not otherwise.
#ifndef KVTIER_TESTS_UTIL_NETNS_CLUSTER_H_
#define KVTIER_TESTS_UTIL_NETNS_CLUSTER_H_

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "testing/store_process.h"

namespace kvtier::testing {

// One kvtier process on a host.
class HostProcess {
 public:
  HostProcess(std::string name, std::vector<std::string> argv, std::string log, std::string port)
      : name_(std::move(name)),
        argv_(std::move(argv)),
        log_path_(std::move(log)),
        port_file_(std::move(port)) {}
  ~HostProcess() { Kill(); }

  // Starts it and waits (up to 30 s) for its port file.
  absl::Status Start() {
    ::unlink(port_file_.c_str());
    pid_ = SpawnLogged(argv_, log_path_);
    if (pid_ < 0) return absl::InternalError("fork failed");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      int status;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return absl::InternalError(absl::StrCat(name_, " exited at start:\n", Tail()));
      }
      std::ifstream in(port_file_);
      if (in >> port_ && port_ > 0) return absl::OkStatus();
      // Polling a file the child writes once; not a synchronization sleep.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    Kill();
    return absl::InternalError(absl::StrCat(name_, " did not start:\n", Tail()));
  }
  // Replaces the argument that starts with `prefix` (for a restart on the
  // port it had: SetArg("--listen=", "--listen=HOST:PORT")).
  void SetArg(const std::string& prefix, std::string arg) {
    for (std::string& a : argv_) {
      if (a.rfind(prefix, 0) == 0) a = std::move(arg);
    }
  }
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }
  void Pause() {
    if (pid_ > 0) ::kill(pid_, SIGSTOP);
  }
  void Resume() {
    if (pid_ > 0) ::kill(pid_, SIGCONT);
  }
  bool running() const { return pid_ > 0; }
  int port() const { return port_; }
  const std::string& name() const { return name_; }
  const std::string& log_path() const { return log_path_; }
  std::string Tail() const {
    std::ifstream in(log_path_);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string s = ss.str();
    return s.size() > 3000 ? s.substr(s.size() - 3000) : s;
  }

 private:
  std::string name_;
  std::vector<std::string> argv_;
  std::string log_path_, port_file_;
  pid_t pid_ = -1;
  int port_ = 0;
};

class NetnsCluster {
 public:
  // `hosts` namespaces with addresses 10.213.N.2, .3, ...; the root
  // namespace is 10.213.N.1 on the bridge. FAILED_PRECONDITION (the test
  // should skip, or fail under CI=true) without root or `ip`.
  static absl::StatusOr<std::unique_ptr<NetnsCluster>> Create(int hosts, std::string dir) {
    if (::geteuid() != 0) {
      return absl::FailedPreconditionError("cluster tests need root (network namespaces)");
    }
    if (std::system("ip -V >/dev/null 2>&1") != 0) {
      return absl::FailedPreconditionError("cluster tests need iproute2's `ip`");
    }
    std::unique_ptr<NetnsCluster> c(new NetnsCluster());
    c->dir_ = std::move(dir);
    c->tag_ = static_cast<int>(::getpid() % 200) + 20;
    c->bridge_ = absl::StrCat("kvtbr", c->tag_);
    c->hosts_ = hosts;
    c->Cleanup();  // What a killed run with the same tag left behind.
    c->hosts_ = 0;
    if (!c->Sh(absl::StrCat("ip link add ", c->bridge_, " type bridge && ip addr add 10.213.",
                            c->tag_, ".1/24 dev ", c->bridge_, " && ip link set ", c->bridge_,
                            " up"))) {
      return absl::FailedPreconditionError("cannot create a bridge (no CAP_NET_ADMIN?)");
    }
    for (int h = 0; h < hosts; ++h) {
      const std::string ns = c->Namespace(h);
      const std::string out = absl::StrCat("kvt", c->tag_, "h", h);
      const std::string in = absl::StrCat("kvt", c->tag_, "p", h);
      if (!c->Sh(absl::StrCat(
              "ip netns add ", ns, " && ip netns exec ", ns, " ip link set lo up && ip link add ",
              out, " type veth peer name ", in, " && ip link set ", in, " netns ", ns,
              " && ip link set ", out, " master ", c->bridge_, " && ip link set ", out,
              " up && ip netns exec ", ns, " ip addr add ", c->Address(h), "/24 dev ", in,
              " && ip netns exec ", ns, " ip link set ", in, " up"))) {
        return absl::InternalError(absl::StrCat("cannot set up host ", h));
      }
      c->hosts_ = h + 1;
    }
    return c;
  }
  ~NetnsCluster() {
    procs_.clear();  // Kills them first.
    Cleanup();
  }
  void Cleanup() {
    for (int h = 0; h < hosts_; ++h) {
      Sh(absl::StrCat("ip netns del ", Namespace(h), " 2>/dev/null; ip link del kvt", tag_, "h", h,
                      " 2>/dev/null; true"));
    }
    Sh(absl::StrCat("ip link del ", bridge_, " 2>/dev/null; true"));
  }

  std::string Address(int host) const { return absl::StrCat("10.213.", tag_, ".", host + 2); }
  std::string Namespace(int host) const { return absl::StrCat("kvt", tag_, "-", host); }

  // Starts `binary args...` on `host`, listening on its address with a
  // bound port written to a file the harness names (pass it as
  // --port_file=PORT_FILE: the literal PORT_FILE in an argument is
  // replaced).
  absl::StatusOr<HostProcess*> Run(int host, const std::string& name, const std::string& binary,
                                   std::vector<std::string> args) {
    const std::string port_file = absl::StrCat(dir_, "/", name, ".port");
    std::vector<std::string> argv = {"ip", "netns", "exec", Namespace(host), binary};
    for (std::string& a : args) {
      const size_t at = a.find("PORT_FILE");
      if (at != std::string::npos) a.replace(at, 9, port_file);
      argv.push_back(std::move(a));
    }
    auto p = std::make_unique<HostProcess>(name, std::move(argv),
                                           absl::StrCat(dir_, "/", name, ".log"), port_file);
    absl::Status s = p->Start();
    if (!s.ok()) return s;
    procs_.push_back(std::move(p));
    return procs_.back().get();
  }

 private:
  NetnsCluster() = default;
  bool Sh(const std::string& cmd) const { return std::system(cmd.c_str()) == 0; }

  std::string dir_, bridge_;
  int tag_ = 0;
  int hosts_ = 0;
  std::vector<std::unique_ptr<HostProcess>> procs_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_UTIL_NETNS_CLUSTER_H_
