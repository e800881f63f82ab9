#include "common/unique_fd.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// Whether `fd` names an open descriptor of this process. The tests run on one thread, so a
// descriptor they closed cannot have been handed out again meanwhile.
bool IsOpen(int fd) { return fcntl(fd, F_GETFD) != -1 || errno != EBADF; }

int OpenDevNull() {
  const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0);
  return fd;
}

TEST(UniqueFdTest, DefaultAndNegativeOwnNothing) {
  UniqueFd none;
  EXPECT_FALSE(none.valid());
  EXPECT_EQ(none.get(), -1);
  UniqueFd failed_open(-5);
  EXPECT_FALSE(failed_open.valid());
  EXPECT_EQ(failed_open.get(), -1);
  EXPECT_TRUE(failed_open.Close("nothing").ok());
}

TEST(UniqueFdTest, DestructorCloses) {
  const int raw = OpenDevNull();
  {
    UniqueFd fd(raw);
    EXPECT_TRUE(fd.valid());
    EXPECT_EQ(fd.get(), raw);
    EXPECT_TRUE(IsOpen(raw));
  }
  EXPECT_FALSE(IsOpen(raw));
}

TEST(UniqueFdTest, ReleaseKeepsTheDescriptorOpen) {
  const int raw = OpenDevNull();
  {
    UniqueFd fd(raw);
    EXPECT_EQ(fd.release(), raw);
    EXPECT_FALSE(fd.valid());
  }
  EXPECT_TRUE(IsOpen(raw));
  ::close(raw);
}

TEST(UniqueFdTest, ResetClosesTheOldAndOwnsTheNew) {
  const int a = OpenDevNull();
  const int b = OpenDevNull();
  UniqueFd fd(a);
  fd.reset(b);
  EXPECT_FALSE(IsOpen(a));
  EXPECT_TRUE(IsOpen(b));
  EXPECT_EQ(fd.get(), b);
  fd.reset(b);  // the descriptor it owns already: kept open
  EXPECT_TRUE(IsOpen(b));
  fd.reset();
  EXPECT_FALSE(IsOpen(b));
  EXPECT_FALSE(fd.valid());
}

TEST(UniqueFdTest, MoveTransfersOwnership) {
  const int a = OpenDevNull();
  const int b = OpenDevNull();
  UniqueFd first(a);
  UniqueFd second(std::move(first));
  EXPECT_FALSE(first.valid());  // NOLINT(bugprone-use-after-move): moved-from state is defined
  EXPECT_EQ(second.get(), a);
  UniqueFd third(b);
  third = std::move(second);  // closes b, owns a
  EXPECT_FALSE(IsOpen(b));
  EXPECT_TRUE(IsOpen(a));
  EXPECT_EQ(third.get(), a);
  UniqueFd& alias = third;
  third = std::move(alias);  // self-move keeps it
  EXPECT_TRUE(IsOpen(a));
  EXPECT_EQ(third.get(), a);
}

TEST(UniqueFdTest, CloseClosesAndReportsSuccess) {
  const int raw = OpenDevNull();
  UniqueFd fd(raw);
  EXPECT_TRUE(fd.Close("/dev/null").ok());
  EXPECT_FALSE(fd.valid());
  EXPECT_FALSE(IsOpen(raw));
}

TEST(UniqueFdTest, CloseReportsTheErrnoWithContext) {
  const int raw = OpenDevNull();
  UniqueFd fd(raw);
  ASSERT_EQ(::close(raw), 0);  // closed behind its back: close() now fails with EBADF
  const absl::Status s = fd.Close("/some/file");
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), StartsWith("close /some/file: "));
  EXPECT_THAT(std::string(s.message()), HasSubstr("Bad file descriptor"));
  EXPECT_FALSE(fd.valid());
}

}  // namespace
}  // namespace slidedp
