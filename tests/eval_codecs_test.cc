// `kvtier eval codecs` end to end: the real binary, a small synthetic trace
// and (when ../shared is there) stories260K; checks the CSV contract.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "testing/test_util.h"

namespace kvtier {
namespace {

std::string Kvtier() {
  const char* b = std::getenv("KVTIER_BUILD_DIR");
  return std::string(b != nullptr ? b : ".") + "/tools/kvtier";
}

std::vector<std::vector<std::string>> ReadCsv(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::vector<std::string>> rows;
  std::string line;
  while (std::getline(in, line)) rows.push_back(absl::StrSplit(line, ','));
  return rows;
}

const char kHeader[] =
    "trace,codec,bits,group,rank,outlier_frac,compression_ratio,k_rel_err,v_rel_err,attn_rel_err,"
    "kl,top1_agree";

TEST(EvalCodecsTest, SyntheticCsvHasTheDocumentedColumns) {
  kvtier::testing::TempDir dir;
  const std::string csv = dir.path() + "/out.csv";
  const std::string cmd = Kvtier() +
                          " eval codecs --synthetic_layers=1 --synthetic_rounds=4 --head_dim=64"
                          " --settings=fp16,kivi4,kivi2,gear2:r=2 --csv=" +
                          csv + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto rows = ReadCsv(csv);
  ASSERT_EQ(rows.size(), 5u);
  std::ifstream in(csv);
  std::string header;
  std::getline(in, header);
  EXPECT_EQ(header, kHeader);
  double prev_err = -1;
  for (size_t i = 1; i < rows.size(); ++i) {
    ASSERT_EQ(rows[i].size(), 12u);
    EXPECT_NE(rows[i][0].find("synthetic"), std::string::npos);
    EXPECT_TRUE(rows[i][10].empty()) << "kl is empty without a model";
    EXPECT_TRUE(rows[i][11].empty());
    EXPECT_FALSE(rows[i][9].empty());
    if (i <= 3) {  // fp16, kivi4, kivi2: error grows, ratio grows.
      const double err = std::stod(rows[i][9]);
      EXPECT_GT(err, prev_err);
      prev_err = err;
    }
  }
  EXPECT_GT(std::stod(rows[3][6]), std::stod(rows[2][6]));
  EXPECT_LT(std::stod(rows[1][9]), 0.01);
  EXPECT_EQ(rows[4][4], "2");
}

TEST(EvalCodecsTest, BadFlagsFailWithUsage) {
  EXPECT_NE(std::system((Kvtier() + " eval codecs --settings=kivi3 > /dev/null 2>&1").c_str()), 0);
  EXPECT_NE(std::system((Kvtier() + " eval codecs --bogus=1 > /dev/null 2>&1").c_str()), 0);
  EXPECT_NE(std::system((Kvtier() + " eval codecs --model=/nonexistent > /dev/null 2>&1").c_str()),
            0);
}

TEST(EvalCodecsTest, Stories260KRowsCarryKlAndTop1) {
  KVT_REQUIRE_SHARED_MODEL(model);
  kvtier::testing::TempDir dir;
  const std::string csv = dir.path() + "/out.csv";
  const std::string cmd = Kvtier() + " eval codecs --model=" + model +
                          " --synthetic=false --sequences=1 --seq_len=160 --queries=16"
                          " --settings=fp32,kivi8,kivi2 --csv=" +
                          csv + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto rows = ReadCsv(csv);
  ASSERT_EQ(rows.size(), 4u);
  for (size_t i = 1; i < rows.size(); ++i) {
    EXPECT_NE(rows[i][0].find("stories"), std::string::npos);
    ASSERT_FALSE(rows[i][10].empty());
    ASSERT_FALSE(rows[i][11].empty());
  }
  // The fp32 "codec" is lossless: KL 0, full agreement.
  EXPECT_LT(std::stod(rows[1][10]), 1e-6);
  EXPECT_EQ(std::stod(rows[1][11]), 1.0);
  EXPECT_LT(std::stod(rows[2][10]), std::stod(rows[3][10]));
}

}  // namespace
}  // namespace kvtier
