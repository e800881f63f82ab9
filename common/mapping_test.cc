#include "common/mapping.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

size_t PageSize() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// Whether [p, p + bytes) is mapped in this process (mincore fails with ENOMEM otherwise). The
// tests run on one thread, so a range they unmapped is not mapped again meanwhile.
bool IsMapped(void* p, size_t bytes) {
  std::vector<unsigned char> pages((bytes + PageSize() - 1) / PageSize());
  return mincore(p, bytes, pages.data()) == 0 || errno != ENOMEM;
}

TEST(MappingTest, AnonymousIsZeroedWritableAndUnmappedOnDestruction) {
  const size_t bytes = 3 * PageSize();
  void* p = nullptr;
  {
    absl::StatusOr<Mapping> m = Mapping::Anonymous(bytes, "test buffer");
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_TRUE(m->valid());
    EXPECT_EQ(m->size(), bytes);
    p = m->data();
    ASSERT_NE(p, nullptr);
    const unsigned char* c = m->as<unsigned char>();
    for (size_t i = 0; i < bytes; i += 512) EXPECT_EQ(c[i], 0) << i;
    std::memset(m->data(), 0x5a, bytes);
    EXPECT_EQ(m->as<unsigned char>()[bytes - 1], 0x5a);
    EXPECT_TRUE(IsMapped(p, bytes));
  }
  EXPECT_FALSE(IsMapped(p, 3 * PageSize()));
}

TEST(MappingTest, ZeroBytesIsInvalidArgument) {
  absl::StatusOr<Mapping> m = Mapping::Anonymous(0, "empty buffer");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), StartsWith("empty buffer: mmap of 0 bytes"));
}

TEST(MappingTest, FailureCarriesErrnoAndContext) {
  // A shared mapping of no file: mmap fails with EBADF.
  absl::StatusOr<Mapping> m =
      Mapping::Map(PageSize(), PROT_READ, MAP_SHARED, /*fd=*/-1, 0, "layer file x");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status(), absl::ErrnoToStatus(
                            EBADF, absl::StrCat("layer file x: mmap of ", PageSize(), " bytes")));
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("Bad file descriptor"));
}

TEST(MappingTest, MapsAFile) {
  UniqueFd fd(memfd_create("mapping_test", MFD_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  const std::string text = "shared bytes";
  ASSERT_EQ(write(fd.get(), text.data(), text.size()), static_cast<ssize_t>(text.size()));
  absl::StatusOr<Mapping> m = Mapping::Map(text.size(), PROT_READ, MAP_SHARED, fd.get(), 0, "x");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(std::string(m->as<const char>(), m->size()), text);
  // The mapping outlives the descriptor.
  ASSERT_TRUE(fd.Close("memfd").ok());
  EXPECT_EQ(std::string(m->as<const char>(), m->size()), text);
}

TEST(MappingTest, MoveTransfersAndAssignmentUnmapsTheOld) {
  const size_t bytes = PageSize();
  absl::StatusOr<Mapping> a = Mapping::Anonymous(bytes, "a");
  absl::StatusOr<Mapping> b = Mapping::Anonymous(bytes, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  void* pa = a->data();
  void* pb = b->data();
  Mapping moved(std::move(*a));
  EXPECT_FALSE(a->valid());  // NOLINT(bugprone-use-after-move): moved-from state is defined
  EXPECT_EQ(a->size(), 0u);
  EXPECT_EQ(moved.data(), pa);
  EXPECT_EQ(moved.size(), bytes);
  moved = std::move(*b);  // unmaps a's range, owns b's
  EXPECT_FALSE(IsMapped(pa, bytes));
  EXPECT_TRUE(IsMapped(pb, bytes));
  EXPECT_EQ(moved.data(), pb);
  moved.reset();
  EXPECT_FALSE(moved.valid());
  EXPECT_EQ(moved.size(), 0u);
  EXPECT_FALSE(IsMapped(pb, bytes));
}

}  // namespace
}  // namespace slidedp
