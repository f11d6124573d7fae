#include "kernels/crc32c.h"

#include <cstdio>
#include <random>
#include <string>
#include <vector>

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

// Every path this CPU has against the table, at lengths around each path's
// thresholds and block sizes (the folding paths start at 256, 512 and 1024
// bytes and fold 64, 128 and 256 bytes a step), from unaligned starts, continuing a CRC.
TEST(Crc32c, EveryPathMatchesPortable) {
  std::mt19937 rng(11);
  std::string buf(70'000, '\0');
  for (char& c : buf) c = static_cast<char>(rng());
  std::vector<size_t> lengths = {0,    1,    15,   16,   17,    255,   256,   257,
                                 319,  320,  321,  1023, 1024,  1025,  1279,  1280,
                                 1281, 1300, 4095, 4096, 12288, 12289, 65536, 69000};
  for (int i = 0; i < 40; ++i) lengths.push_back(rng() % 9000);
  for (Crc32cPath path :
       {Crc32cPath::kPortable, Crc32cPath::kSse42, Crc32cPath::kPclmul, Crc32cPath::kVpclmul}) {
    if (!Crc32cPathAvailable(path)) {
      std::printf("crc32c path %s: not on this CPU\n", Crc32cPathName(path));
      continue;
    }
    for (size_t off : {0u, 1u, 3u, 8u, 13u}) {
      for (size_t len : lengths) {
        if (off + len > buf.size()) continue;
        const uint32_t seed = static_cast<uint32_t>(rng());
        ASSERT_EQ(Crc32cExtendWith(path, seed, buf.data() + off, len),
                  Crc32cExtendPortable(seed, buf.data() + off, len))
            << Crc32cPathName(path) << " offset " << off << " length " << len;
      }
    }
  }
  std::printf("crc32c in use: %s\n", Crc32cPathName(Crc32cActivePath()));
}

TEST(Crc32c, ExtendEqualsWhole) {
  std::string a = "hello, ", b = "kvtier";
  EXPECT_EQ(Crc32cExtend(Crc32c(a), b.data(), b.size()), Crc32c(a + b));
}

// Combining the CRCs of a and b gives the CRC of a + b, for lengths of b
// around the 256-byte zero block it runs through, and empty parts.
TEST(Crc32c, CombineEqualsWhole) {
  std::mt19937 rng(11);
  auto random = [&](size_t n) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    return s;
  };
  for (size_t la : {0u, 1u, 13u, 300u}) {
    for (size_t lb : {0u, 1u, 7u, 255u, 256u, 257u, 1000u, 70000u}) {
      const std::string a = random(la), b = random(lb);
      EXPECT_EQ(Crc32cCombine(Crc32c(a), Crc32c(b), b.size()), Crc32c(a + b)) << la << " + " << lb;
    }
  }
  // A chain: the CRC of many parts from theirs alone.
  std::string whole;
  uint32_t crc = 0;
  for (int i = 0; i < 50; ++i) {
    const std::string part = random(rng() % 400);
    crc = Crc32cCombine(crc, Crc32c(part), part.size());
    whole += part;
  }
  EXPECT_EQ(crc, Crc32c(whole));
}

}  // namespace
}  // namespace kvtier
