// Structured logs: one JSON object per line on stderr, e.g.
//   {"ts":"2026-11-22T10:00:00.123Z","level":"info","msg":"listening","addr":"127.0.0.1:5000"}
#ifndef KVTIER_BASE_LOG_H_
#define KVTIER_BASE_LOG_H_

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvtier {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

// A key/value field of a log line. Numbers are written unquoted.
struct LogField {
  LogField(std::string_view k, std::string_view v) : key(k), value(v), quoted(true) {}
  LogField(std::string_view k, const char* v) : key(k), value(v), quoted(true) {}
  LogField(std::string_view k, const std::string& v) : key(k), value(v), quoted(true) {}
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
  LogField(std::string_view k, T v) : key(k), value(absl::StrCat(v)), quoted(false) {}
  std::string key;
  std::string value;
  bool quoted;
};

// Lines below `level` are dropped. Default kInfo. Thread-safe.
void SetLogLevel(LogLevel level);
// Parses "debug", "info", "warn", "error"; returns false on anything else.
bool ParseLogLevel(std::string_view name, LogLevel* level);

// Writes one line atomically. Thread-safe.
void Log(LogLevel level, std::string_view msg, std::initializer_list<LogField> fields = {});

inline void LogDebug(std::string_view msg, std::initializer_list<LogField> f = {}) {
  Log(LogLevel::kDebug, msg, f);
}
inline void LogInfo(std::string_view msg, std::initializer_list<LogField> f = {}) {
  Log(LogLevel::kInfo, msg, f);
}
inline void LogWarn(std::string_view msg, std::initializer_list<LogField> f = {}) {
  Log(LogLevel::kWarn, msg, f);
}
inline void LogError(std::string_view msg, std::initializer_list<LogField> f = {}) {
  Log(LogLevel::kError, msg, f);
}

// Escapes `s` for a JSON string body.
std::string JsonEscape(std::string_view s);

}  // namespace kvtier

#endif  // KVTIER_BASE_LOG_H_
