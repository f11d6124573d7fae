#include "testing/store_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"

namespace kvtier::testing {
namespace {

int ReadPort(const std::string& path) {
  std::ifstream in(path);
  int port = 0;
  if (in >> port) return port;
  return 0;
}

std::string Tail(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  return s.size() > 2000 ? s.substr(s.size() - 2000) : s;
}

}  // namespace

std::string StoreBinary() {
  if (const char* env = std::getenv("KVTIER_STORE_BINARY")) return env;
  return KVTIER_STORE_BINARY_PATH;
}

pid_t SpawnLogged(std::vector<std::string> args, const std::string& log_path) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd >= 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
  }
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  ::_exit(127);
}

StoreProcess::StoreProcess(std::string data_dir, std::vector<std::string> extra_flags)
    : data_dir_(std::move(data_dir)), flags_(std::move(extra_flags)) {
  log_path_ = data_dir_ + ".log";
}

StoreProcess::~StoreProcess() { Kill(); }

absl::Status StoreProcess::Start() {
  const std::string port_file = data_dir_ + ".port";
  const std::string metrics_file = data_dir_ + ".mport";
  ::unlink(port_file.c_str());
  ::unlink(metrics_file.c_str());
  std::vector<std::string> args = {StoreBinary(),
                                   "--listen=127.0.0.1:0",
                                   "--metrics_listen=127.0.0.1:0",
                                   "--data_dir=" + data_dir_,
                                   "--port_file=" + port_file,
                                   "--metrics_port_file=" + metrics_file};
  args.insert(args.end(), flags_.begin(), flags_.end());
  pid_ = SpawnLogged(std::move(args), log_path_);
  if (pid_ < 0) return absl::InternalError("fork failed");
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    int status;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("kvtier-store exited at start:\n", Tail(log_path_)));
    }
    port_ = ReadPort(port_file);
    metrics_port_ = ReadPort(metrics_file);
    if (port_ > 0 && metrics_port_ > 0) return absl::OkStatus();
    // Polling a file the child writes once; not a synchronization sleep.
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  Kill();
  return absl::InternalError(absl::StrCat("kvtier-store did not start:\n", Tail(log_path_)));
}

void StoreProcess::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
}

void StoreProcess::Pause() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGSTOP);
  // The stop takes hold when one of the store's threads next runs; until
  // then its other threads keep serving (on a loaded machine, long enough
  // to answer the caller's next request). Wait until it has stopped.
  int status = 0;
  pid_t got;
  do {
    got = ::waitpid(pid_, &status, WUNTRACED);
  } while (got < 0 && errno == EINTR);
  if (got == pid_ && !WIFSTOPPED(status)) pid_ = -1;  // It exited instead.
}

void StoreProcess::Resume() {
  if (pid_ > 0) ::kill(pid_, SIGCONT);
}

int StoreProcess::Stop() {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGCONT);  // A paused process would not see SIGTERM.
  ::kill(pid_, SIGTERM);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace kvtier::testing
