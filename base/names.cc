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

absl::Status ValidateAddress(std::string_view what, std::string_view address) {
  const std::string w(what);
  if (address.empty() || address.size() > kMaxAddressLength) {
    return absl::InvalidArgumentError(
        absl::StrCat(w, " must be 1 to ", kMaxAddressLength, " characters, got ", address.size()));
  }
  for (size_t i = 0; i < address.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(address[i]);
    if (c <= 0x20 || c >= 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat(w, " holds byte 0x", absl::Hex(c), " at offset ", i,
                       ": whitespace, control and non-ASCII bytes are not allowed"));
    }
  }
  auto bad = [&](const char* why) {
    return absl::InvalidArgumentError(absl::StrCat(w, " must be HOST:PORT or unix:PATH, got '",
                                                   std::string(address), "': ", why));
  };
  if (address.substr(0, 5) == "unix:") {
    return address.size() > 5 ? absl::OkStatus() : bad("the path is empty");
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos) return bad("no port");
  const std::string_view host = address.substr(0, colon);
  const std::string_view port = address.substr(colon + 1);
  if (port.empty() || port.size() > 5) return bad("the port must be 1 to 65535");
  uint32_t p = 0;
  for (char c : port) {
    if (c < '0' || c > '9') return bad("the port must be decimal");
    p = p * 10 + static_cast<uint32_t>(c - '0');
  }
  if (p == 0 || p > 65535) return bad("the port must be 1 to 65535");
  if (host.empty()) return bad("the host is empty");
  if (host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') return bad("an IPv6 host must be [ADDRESS]");
    for (char c : host.substr(1, host.size() - 2)) {
      const bool ok = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F') ||
                      c == ':' || c == '.' || c == '%';
      if (!ok) return bad("an IPv6 host holds only hex digits, ':' and '.'");
    }
    return absl::OkStatus();
  }
  for (char c : host) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '-' || c == '_';
    if (!ok) return bad("a host name holds only [A-Za-z0-9._-]");
  }
  return absl::OkStatus();
}

}  // namespace kvtier
