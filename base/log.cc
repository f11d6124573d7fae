#include "base/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvtier {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kError:
      return "error";
  }
  return "info";
}

}  // namespace

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }

bool ParseLogLevel(std::string_view name, LogLevel* level) {
  for (LogLevel l : {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarn, LogLevel::kError}) {
    if (name == LevelName(l)) {
      *level = l;
      return true;
    }
  }
  return false;
}

std::string JsonEscape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

void Log(LogLevel level, std::string_view msg, std::initializer_list<LogField> fields) {
  if (static_cast<int>(level) < g_level.load()) return;
  std::string line = absl::StrCat(
      "{\"ts\":\"", absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()),
      "\",\"level\":\"", LevelName(level), "\",\"msg\":\"", JsonEscape(msg), "\"");
  for (const LogField& f : fields) {
    absl::StrAppend(&line, ",\"", JsonEscape(f.key), "\":");
    if (f.quoted) {
      absl::StrAppend(&line, "\"", JsonEscape(f.value), "\"");
    } else {
      absl::StrAppend(&line, f.value);
    }
  }
  line += "}\n";
  // One write(2) per line keeps lines whole across threads and processes.
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;  // Deliberately ignored: nowhere to report a failed log write.
}

}  // namespace kvtier
