#include "base/names.h"

#include "absl/strings/str_cat.h"

namespace kvtier {

absl::Status ValidateName(std::string_view what, std::string_view name) {
  if (name.empty() || name.size() > kMaxNameLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(what), " must be 1 to ", kMaxNameLength, " characters, got ", name.size()));
  }
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == ':' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(std::string(what), " may hold only [A-Za-z0-9._:-], got a byte 0x",
                       absl::Hex(static_cast<unsigned char>(c))));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvtier
