// testing::SelfChild, which the CUDA IPC checks use to get a second process
// (worker_device_test, kvtier-gpu-bench): the child is this binary again,
// talks over its stdin and stdout, and its exit status comes back.
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "testing/test_util.h"

namespace kvtier::testing {
namespace {

// Run only as the child: echoes its first input line, then exits with the
// status the line asks for.
TEST(SelfChildProcess, DISABLED_Echo) {
  char line[64];
  ASSERT_NE(std::fgets(line, sizeof(line), stdin), nullptr);
  std::printf("ECHO %s", line);
  std::fflush(stdout);
  int code = 0;
  if (std::sscanf(line, "exit %d", &code) == 1) std::exit(code);
}

TEST(SelfChildTest, TheChildIsThisBinaryTalkingOverPipes) {
  SelfChild child(
      {"--gtest_also_run_disabled_tests", "--gtest_filter=SelfChildProcess.DISABLED_Echo"});
  ASSERT_TRUE(child.started());
  ASSERT_TRUE(child.Send("hello\n"));
  std::string out;
  char line[256];
  bool echoed = false;
  while (!echoed && std::fgets(line, sizeof(line), child.out()) != nullptr) {
    out += line;
    echoed = std::strcmp(line, "ECHO hello\n") == 0;
  }
  EXPECT_TRUE(echoed) << out;
  const int status = child.Wait(&out);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_NE(out.find("[  PASSED  ] 1 test"), std::string::npos) << out;
  EXPECT_EQ(child.Wait(), status) << "a second Wait gives the same status";
}

TEST(SelfChildTest, ItsExitStatusComesBack) {
  SelfChild child(
      {"--gtest_also_run_disabled_tests", "--gtest_filter=SelfChildProcess.DISABLED_Echo"});
  ASSERT_TRUE(child.Send("exit 3\n"));
  const int status = child.Wait();
  EXPECT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 3);
}

TEST(SelfChildTest, ClosingItsInputEndsAChildThatWaitsForIt) {
  SelfChild child(
      {"--gtest_also_run_disabled_tests", "--gtest_filter=SelfChildProcess.DISABLED_Echo"});
  std::string out;
  const int status = child.Wait(&out);  // EOF on its stdin: its ASSERT fails.
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << out;
  EXPECT_NE(out.find("FAILED"), std::string::npos) << out;
}

}  // namespace
}  // namespace kvtier::testing
