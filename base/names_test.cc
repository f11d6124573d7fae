#include "base/names.h"

#include <string>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

TEST(ValidateAddressTest, TakesHostPortAndUnixPaths) {
  for (const char* ok :
       {"127.0.0.1:7070", "localhost:1", "kvtier-store-0.svc.cluster.local:65535", "[::1]:7070",
        "[fe80::1]:80", "unix:/run/kvtier/store.sock", "store_a:7070"}) {
    EXPECT_TRUE(ValidateAddress("address", ok).ok()) << ok;
  }
}

TEST(ValidateAddressTest, RefusesWhatCannotBeAnAddressWithAPreciseReason) {
  struct Case {
    std::string address;
    const char* reason;
  };
  const Case cases[] = {
      {"", "1 to 255 characters, got 0"},
      {std::string(256, 'a'), "1 to 255 characters, got 256"},
      {"127.0.0.1:70 70", "byte 0x20 at offset 12"},
      {"127.0.0.1:7070\n", "byte 0xa at offset 14"},
      {std::string("127.0.0.1:7\0", 12), "byte 0x0 at offset 11"},
      {"h\xc3\xa9:1", "byte 0xc3 at offset 1"},
      {"127.0.0.1", "no port"},
      {"127.0.0.1:", "1 to 65535"},
      {"127.0.0.1:0", "1 to 65535"},
      {"127.0.0.1:65536", "1 to 65535"},
      {"127.0.0.1:+80", "decimal"},
      {":7070", "the host is empty"},
      {"[::1:7070", "[ADDRESS]"},
      {"[::g]:7070", "hex digits"},
      {"evil/host:7070", "[A-Za-z0-9._-]"},
      {"a@b:7070", "[A-Za-z0-9._-]"},
      {"unix:", "the path is empty"},
  };
  for (const Case& c : cases) {
    const absl::Status s = ValidateAddress("store address", c.address);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.address;
    EXPECT_NE(s.message().find(c.reason), std::string::npos) << c.address << ": " << s.message();
    EXPECT_EQ(s.message().rfind("store address", 0), 0u) << s.message();
  }
}

TEST(ValidateAddressTest, NeverEchoesMoreThanTheBound) {
  const std::string huge(10'000, 'x');
  const absl::Status s = ValidateAddress("address", huge + ":1");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(s.message().size(), 200u) << s.message();
  const absl::Status bad_port = ValidateAddress("address", std::string(250, 'x') + ":abc");
  EXPECT_LT(bad_port.message().size(), 2 * kMaxAddressLength);
}

}  // namespace
}  // namespace kvtier
