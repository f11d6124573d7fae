#include "cachestore/keys.h"

#include "absl/strings/str_cat.h"

namespace kvtier::cachestore {
namespace {

void PutBe32(std::string* out, uint32_t v) {
  char b[4] = {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
               static_cast<char>(v)};
  out->append(b, 4);
}

uint32_t GetBe32(std::string_view s) {
  auto u = [&](int i) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i])); };
  return (u(0) << 24) | (u(1) << 16) | (u(2) << 8) | u(3);
}

}  // namespace

std::string SessionKey(std::string_view tenant, std::string_view session) {
  std::string k;
  k.reserve(tenant.size() + session.size() + 2);
  k.append(tenant);
  k.push_back('\0');
  k.append(session);
  k.push_back('\0');
  return k;
}

std::string SegmentDbKey(KeyKind kind, std::string_view session_key, uint32_t round,
                         uint32_t segment) {
  std::string k(1, static_cast<char>(kind));
  k.append(session_key);
  PutBe32(&k, round);
  PutBe32(&k, segment);
  return k;
}

std::string RoundDbKey(KeyKind kind, std::string_view session_key, uint32_t round) {
  std::string k(1, static_cast<char>(kind));
  k.append(session_key);
  PutBe32(&k, round);
  return k;
}

std::string SessionDbKey(std::string_view session_key) {
  std::string k(1, static_cast<char>(KeyKind::kSession));
  k.append(session_key);
  return k;
}

std::optional<ParsedKey> ParseDbKey(std::string_view key) {
  if (key.empty()) return std::nullopt;
  ParsedKey p;
  p.kind = static_cast<KeyKind>(key[0]);
  size_t tail;
  switch (p.kind) {
    case KeyKind::kPayload:
    case KeyKind::kSegment:
      tail = 8;
      break;
    case KeyKind::kRound:
    case KeyKind::kRecall:
      tail = 4;
      break;
    case KeyKind::kSession:
      tail = 0;
      break;
    default:
      return std::nullopt;
  }
  std::string_view rest = key.substr(1);
  size_t z1 = rest.find('\0');
  if (z1 == std::string_view::npos || z1 == 0) return std::nullopt;
  size_t z2 = rest.find('\0', z1 + 1);
  if (z2 == std::string_view::npos || z2 == z1 + 1) return std::nullopt;
  if (rest.size() != z2 + 1 + tail) return std::nullopt;
  p.tenant = std::string(rest.substr(0, z1));
  p.session = std::string(rest.substr(z1 + 1, z2 - z1 - 1));
  std::string_view nums = rest.substr(z2 + 1);
  if (tail >= 4) p.round = GetBe32(nums);
  if (tail == 8) p.segment = GetBe32(nums.substr(4));
  return p;
}

}  // namespace kvtier::cachestore
