// A TCP listener on 127.0.0.1 (port 0) that never answers: what a hostile
// tenant would name as a "store" to catch a worker's credentials. The
// kernel completes every handshake into the listen backlog, so Connections()
// counts every connection anyone opened to it, accepted or not, without
// waiting.
#ifndef KVTIER_TESTS_UTIL_TRAP_LISTENER_H_
#define KVTIER_TESTS_UTIL_TRAP_LISTENER_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvtier::testing {

class TrapListener {
 public:
  TrapListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof(a);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
        ::listen(fd_, 64) != 0 || ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = -1;
      return;
    }
    port_ = ntohs(a.sin_port);
  }
  ~TrapListener() {
    for (int c : accepted_) ::close(c);
    if (fd_ >= 0) ::close(fd_);
  }
  TrapListener(const TrapListener&) = delete;
  TrapListener& operator=(const TrapListener&) = delete;

  bool ok() const { return fd_ >= 0; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

  // Connections made to it so far.
  int Connections() {
    for (;;) {
      const int c = ::accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (c < 0) break;
      accepted_.push_back(c);
    }
    return static_cast<int>(accepted_.size());
  }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::vector<int> accepted_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_UTIL_TRAP_LISTENER_H_
