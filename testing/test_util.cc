#include "testing/test_util.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>

#include "encoded/encoded_tensor.h"
#include "kvtier/v1/tensor.pb.h"

namespace kvtier::testing {

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  if (!out.flush()) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::abort();
  }
}

absl::StatusOr<SelfSignedCert> MakeSelfSignedCert(const std::string& dir) {
  if (std::system("command -v openssl >/dev/null 2>&1") != 0) {
    return absl::UnavailableError("openssl CLI not installed; `make deps` installs it");
  }
  SelfSignedCert c;
  c.cert = dir + "/cert.pem";
  c.key = dir + "/key.pem";
  const std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -keyout " + c.key + " -out " +
                          c.cert +
                          " -days 1 -subj /CN=localhost -addext subjectAltName=DNS:localhost "
                          ">/dev/null 2>&1";
  if (std::system(cmd.c_str()) != 0) {
    return absl::InternalError("openssl could not make a self-signed certificate in " + dir);
  }
  std::ifstream in(c.cert);
  c.pem.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (c.pem.empty()) return absl::InternalError("openssl wrote no certificate to " + c.cert);
  return c;
}

namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path) {
  std::ifstream in(path);
  std::string pem((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (pem.empty()) return absl::InternalError("openssl wrote nothing to " + path);
  return pem;
}

}  // namespace

std::string ReadFileOrDie(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    std::abort();
  }
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

absl::StatusOr<TestCa> TestCa::Make(const std::string& dir, const std::string& name) {
  if (std::system("command -v openssl >/dev/null 2>&1") != 0) {
    return absl::UnavailableError("openssl CLI not installed; `make deps` installs it");
  }
  TestCa ca;
  ca.dir_ = dir;
  ca.ca_.cert = dir + "/" + name + ".pem";
  ca.ca_.key = dir + "/" + name + ".key";
  const std::string cmd =
      "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 "
      "-nodes -keyout " +
      ca.ca_.key + " -out " + ca.ca_.cert + " -days 1 -subj /CN=" + name +
      " -addext basicConstraints=critical,CA:TRUE "
      "-addext keyUsage=critical,keyCertSign,cRLSign >/dev/null 2>&1";
  if (std::system(cmd.c_str()) != 0) {
    return absl::InternalError("openssl could not make a CA in " + dir);
  }
  auto pem = ReadPem(ca.ca_.cert);
  if (!pem.ok()) return pem.status();
  ca.ca_.pem = *std::move(pem);
  return ca;
}

absl::StatusOr<SelfSignedCert> TestCa::Issue(const std::string& name,
                                             const std::string& san) const {
  SelfSignedCert c;
  c.cert = dir_ + "/" + name + ".pem";
  c.key = dir_ + "/" + name + ".key";
  const std::string csr = dir_ + "/" + name + ".csr";
  const std::string ext = dir_ + "/" + name + ".ext";
  {
    std::ofstream f(ext);
    f << "subjectAltName=" << san << "\nbasicConstraints=CA:FALSE\n"
      << "extendedKeyUsage=serverAuth,clientAuth\n";
  }
  const std::string cmd =
      "openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout " + c.key +
      " -out " + csr + " -subj /CN=" + name + " >/dev/null 2>&1 && openssl x509 -req -in " + csr +
      " -CA " + ca_.cert + " -CAkey " + ca_.key + " -CAcreateserial -days 1 -extfile " + ext +
      " -out " + c.cert + " >/dev/null 2>&1";
  if (std::system(cmd.c_str()) != 0) {
    return absl::InternalError("openssl could not issue a certificate for " + name);
  }
  auto pem = ReadPem(c.cert);
  if (!pem.ok()) return pem.status();
  c.pem = *std::move(pem);
  return c;
}

std::string MakePayload(uint64_t target_bytes, uint64_t seed, uint32_t layer_begin) {
  // About 24 bytes of protobuf framing around the raw buffer.
  uint64_t raw = target_bytes > 64 ? target_bytes - 48 : 16;
  uint64_t elements = raw / 2;
  v1::SegmentPayload payload;
  v1::EncodedTensor* t = payload.add_tensors();
  t->set_codec(v1::CODEC_RAW);
  t->set_dtype(v1::DTYPE_FP16);
  t->add_shape(static_cast<int64_t>(elements));
  t->set_layer_begin(layer_begin);
  v1::Buffer* b = t->add_buffers();
  b->set_kind(v1::BUFFER_RAW);
  std::string* data = b->mutable_data();
  data->resize(elements * 2);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i + 8 <= data->size(); i += 8) {
    uint64_t v = rng();
    std::memcpy(data->data() + i, &v, 8);
  }
  for (size_t i = data->size() & ~size_t{7}; i < data->size(); ++i) {
    (*data)[i] = static_cast<char>(rng());
  }
  SealTensor(t);
  return payload.SerializeAsString();
}

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/kvtier-test-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string SharedModelPath() {
  if (const char* env = std::getenv("KVTIER_MODEL"); env != nullptr && *env != '\0') {
    return std::filesystem::exists(env) ? std::string(env) : std::string();
  }
  const char* src = std::getenv("KVTIER_SOURCE_DIR");
  const std::filesystem::path root = src != nullptr ? src : KVTIER_SOURCE_DIR_DEFAULT;
  const std::filesystem::path p = root / ".." / "shared" / "models" / "stories260K.bin";
  return std::filesystem::exists(p) ? p.lexically_normal().string() : std::string();
}

std::string SourcePath(const std::string& relative) {
  const char* src = std::getenv("KVTIER_SOURCE_DIR");
  const std::filesystem::path root = src != nullptr ? src : KVTIER_SOURCE_DIR_DEFAULT;
  return (root / relative).lexically_normal().string();
}

bool InCi() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

std::string HttpGet(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  (void)!::write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
  ::close(fd);
  return out;
}

SelfChild::SelfChild(const std::vector<std::string>& args) {
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0) return;
  if (pipe(from_child) != 0) {
    close(to_child[0]);
    close(to_child[1]);
    return;
  }
  std::vector<char*> argv;
  std::string self = "/proc/self/exe";
  argv.push_back(self.data());
  std::vector<std::string> copy = args;
  for (std::string& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    close(to_child[0]);
    close(to_child[1]);
    close(from_child[0]);
    close(from_child[1]);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  if (pid < 0) {
    close(to_child[1]);
    close(from_child[0]);
    return;
  }
  pid_ = pid;
  in_ = to_child[1];
  out_ = fdopen(from_child[0], "r");
  if (out_ == nullptr) close(from_child[0]);
}

SelfChild::~SelfChild() { Wait(); }

bool SelfChild::Send(const std::string& text) {
  if (in_ < 0) return false;
  return write(in_, text.data(), text.size()) == static_cast<ssize_t>(text.size());
}

int SelfChild::Wait(std::string* rest) {
  if (waited_) return status_;
  waited_ = true;
  if (in_ >= 0) close(in_);
  in_ = -1;
  if (out_ != nullptr) {
    // Read to the end, so that the child never writes into a closed pipe.
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), out_)) > 0) {
      if (rest != nullptr) rest->append(buf, n);
    }
    std::fclose(out_);
  }
  out_ = nullptr;
  if (pid_ > 0 && waitpid(pid_, &status_, 0) != pid_) status_ = -1;
  return status_;
}

}  // namespace kvtier::testing
