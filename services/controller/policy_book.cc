#include "services/controller/policy_book.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/names.h"
#include "base/status_macros.h"
#include "encoded/encode.h"
#include "kernels/crc32c.h"
#include "rpc/policy_proto.h"

namespace kvtier {
namespace {

constexpr char kMagic[] = "kvtier-policies 1\n";
constexpr uint32_t kDefaultWindow = 32;  // SnapKV's published default.

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

// A worker must be able to open a session with the policy as registered and
// as tightened.
absl::Status Validate(const v1::SetPolicyRequest& req) {
  KVT_RETURN_IF_ERROR(ValidateName("model_name", req.model_name()));
  for (const bool tighten : {false, true}) {
    const v1::GetPolicyResponse a = AnswerPolicy(req, tighten);
    absl::StatusOr<worker::SessionPolicy> p = PolicyFromAnswer(a, DType::kFp16);
    if (!p.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(tighten ? "the tightened policy: " : "", p.status().message()));
    }
  }
  return absl::OkStatus();
}

absl::Status SyncedWrite(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("open ", tmp, ": ", std::strerror(errno)));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat("write ", tmp, ": ", std::strerror(e)));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    return absl::InternalError(absl::StrCat("fsync ", tmp, ": ", std::strerror(errno)));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("rename to ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<PolicyBook>> PolicyBook::Open(std::string path) {
  std::unique_ptr<PolicyBook> book(new PolicyBook(path));
  if (path.empty()) return book;
  std::ifstream in(path, std::ios::binary);
  if (!in) return book;  // No policies registered yet.
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string bytes = ss.str();
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat("policy file ", path, ": ", why));
  };
  const size_t magic = sizeof(kMagic) - 1;
  if (bytes.size() < magic + 4 || bytes.compare(0, magic, kMagic) != 0) {
    return bad("not a kvtier-policies 1 file");
  }
  const size_t body = bytes.size() - 4;
  if (Crc32cExtend(0, bytes.data(), body) != GetU32(bytes.data() + body)) {
    return bad("checksum mismatch");
  }
  absl::MutexLock lock(&book->mu_);
  for (size_t at = magic; at < body;) {
    if (body - at < 4) return bad("truncated entry");
    const uint32_t n = GetU32(bytes.data() + at);
    at += 4;
    if (body - at < n) return bad("truncated entry");
    v1::SetPolicyRequest req;
    if (!req.ParseFromArray(bytes.data() + at, static_cast<int>(n))) return bad("bad entry");
    at += n;
    book->policies_[req.model_name()] = std::move(req);
  }
  return book;
}

absl::Status PolicyBook::WriteLocked(const std::map<std::string, v1::SetPolicyRequest>& all) const {
  if (path_.empty()) return absl::OkStatus();
  std::string out = kMagic;
  for (const auto& [name, req] : all) {
    const std::string e = req.SerializeAsString();
    PutU32(&out, static_cast<uint32_t>(e.size()));
    out += e;
  }
  PutU32(&out, Crc32c(out));
  return SyncedWrite(path_, out);
}

std::unique_ptr<PolicyBook> PolicyBook::OpenShared(PolicyRemote remote) {
  return std::unique_ptr<PolicyBook>(new PolicyBook(std::move(remote)));
}

absl::StatusOr<bool> PolicyBook::Set(const v1::SetPolicyRequest& req) {
  KVT_RETURN_IF_ERROR(Validate(req));
  if (remote_.put) {
    KVT_ASSIGN_OR_RETURN(std::optional<std::string> was, remote_.get(req.model_name()));
    KVT_RETURN_IF_ERROR(remote_.put(req.model_name(), req.SerializeAsString()));
    absl::MutexLock lock(&mu_);
    policies_[req.model_name()] = req;
    return was.has_value();
  }
  absl::MutexLock lock(&mu_);
  std::map<std::string, v1::SetPolicyRequest> next = policies_;
  const bool replaced = next.count(req.model_name()) > 0;
  next[req.model_name()] = req;
  KVT_RETURN_IF_ERROR(WriteLocked(next));
  policies_ = std::move(next);
  return replaced;
}

std::optional<v1::SetPolicyRequest> PolicyBook::Get(const std::string& model_name) const {
  if (remote_.get) {
    absl::StatusOr<std::optional<std::string>> got = remote_.get(model_name);
    v1::SetPolicyRequest req;
    absl::MutexLock lock(&mu_);
    if (got.ok()) {
      if (!got->has_value() || !req.ParseFromString(**got)) {
        policies_.erase(model_name);
        return std::nullopt;
      }
      policies_[model_name] = req;
      return req;
    }
    // The remote cannot be reached: the last answer.
  }
  absl::MutexLock lock(&mu_);
  auto it = policies_.find(model_name);
  if (it == policies_.end()) return std::nullopt;
  return it->second;
}

size_t PolicyBook::size() const {
  absl::MutexLock lock(&mu_);
  return policies_.size();
}

v1::GetPolicyResponse AnswerPolicy(const v1::SetPolicyRequest& registered, bool tighten) {
  v1::GetPolicyResponse a;
  *a.mutable_policy() = registered.policy();
  a.mutable_layer_budgets()->CopyFrom(registered.layer_budgets());
  a.set_profile_name(registered.profile_name());
  if (!a.layer_budgets().empty()) a.mutable_policy()->set_eviction("profile");
  if (!tighten) return a;
  a.set_tightened(true);
  v1::Policy& p = *a.mutable_policy();
  v1::CodecParams& cp = *p.mutable_codec_params();
  switch (p.codec()) {
    case v1::CODEC_UNSPECIFIED:
    case v1::CODEC_RAW:
      p.set_codec(v1::CODEC_KIVI);
      cp.Clear();
      cp.set_bits(4);
      break;
    case v1::CODEC_KIVI:
    case v1::CODEC_KCVT:
    case v1::CODEC_GEAR:
    case v1::CODEC_GEAR_L: {
      const bool gear = p.codec() == v1::CODEC_GEAR || p.codec() == v1::CODEC_GEAR_L;
      const uint32_t bits = cp.bits() != 0 ? cp.bits() : (gear ? 2 : 4);
      cp.set_bits(std::max<uint32_t>(2, bits / 2));
      break;
    }
    default:
      break;
  }
  const uint32_t floor = (p.window() != 0 ? p.window() : kDefaultWindow) + 1;
  auto halve = [floor](uint32_t b) { return std::max(floor, b / 2); };
  if (p.budget_tokens() != 0) p.set_budget_tokens(halve(p.budget_tokens()));
  for (uint32_t& b : *a.mutable_layer_budgets()) b = halve(b);
  return a;
}

}  // namespace kvtier
