#include "kernels/crc32c.h"

#include <random>
#include <string>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

TEST(Crc32c, KnownVectors) {
  // RFC 3720 B.4 and the common check value.
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(""), 0u);
}

TEST(Crc32c, HardwareMatchesPortableAtEveryAlignment) {
  std::mt19937 rng(7);
  std::string buf;
  buf.resize(50'000);
  for (char& c : buf) c = static_cast<char>(rng());
  for (size_t off = 0; off < 9; ++off) {
    // Lengths around the 3 x 4 KiB stripes of the hardware path too.
    for (size_t len : {0u, 1u, 7u, 8u, 9u, 63u, 4000u, 12287u, 12288u, 12289u, 40000u}) {
      EXPECT_EQ(Crc32cExtend(0, buf.data() + off, len),
                Crc32cExtendPortable(0, buf.data() + off, len))
          << off << " " << len;
    }
  }
}

TEST(Crc32c, ExtendEqualsWhole) {
  std::string a = "hello, ", b = "kvtier";
  EXPECT_EQ(Crc32cExtend(Crc32c(a), b.data(), b.size()), Crc32c(a + b));
}

}  // namespace
}  // namespace kvtier
