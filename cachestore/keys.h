// RocksDB key layout of the store. Every key starts with a one-byte kind,
// then the session key "<tenant>\0<session>\0" (names never hold NUL), then
// big-endian round and segment numbers so keys sort by round:
//   'd' session round segment  -> payload bytes (serialized SegmentPayload)
//   'i' session round segment  -> internal::SegmentRecord
//   'r' session round          -> internal::RoundRecord
//   'c' session round          -> internal::RecallRecord
//   'm' session                -> internal::SessionRecord
#ifndef KVTIER_CACHESTORE_KEYS_H_
#define KVTIER_CACHESTORE_KEYS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kvtier::cachestore {

enum class KeyKind : char {
  kPayload = 'd',
  kSegment = 'i',
  kRound = 'r',
  kRecall = 'c',
  kSession = 'm',
};

std::string SessionKey(std::string_view tenant, std::string_view session);
std::string SegmentDbKey(KeyKind kind, std::string_view session_key, uint32_t round,
                         uint32_t segment);
std::string RoundDbKey(KeyKind kind, std::string_view session_key, uint32_t round);
std::string SessionDbKey(std::string_view session_key);

// The parts of a key read back during recovery.
struct ParsedKey {
  KeyKind kind;
  std::string tenant;
  std::string session;
  uint32_t round = 0;
  uint32_t segment = 0;
};

// Parses any key above; nullopt when it is not one of ours or is malformed.
std::optional<ParsedKey> ParseDbKey(std::string_view key);

}  // namespace kvtier::cachestore

#endif  // KVTIER_CACHESTORE_KEYS_H_
