#include "common/shm_segment.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/thread_pool.h"
#include "gtest/gtest.h"

namespace slidedp {
namespace {

std::string UniqueInstance(const std::string& tag) {
  static std::atomic<int> counter{0};
  return absl::StrCat("t", getpid(), "-", tag, "-", counter.fetch_add(1));
}

TEST(ShmSegmentTest, CreateMapsExactSizeWithMode) {
  const std::string name = "slidedp." + UniqueInstance("seg");
  ShmSegment::CreateOptions o;
  o.name = name;
  o.size_bytes = 3 * 4096;
  o.mode = 0600;
  auto seg = ShmSegment::Create(o);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_TRUE(seg->locked());
  struct stat st;
  ASSERT_EQ(stat(("/dev/shm/" + name).c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 3 * 4096);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  std::memset(seg->data(), 0x5a, seg->size_bytes());

  auto reader = ShmSegment::Open(name, /*writable=*/false);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->size_bytes(), 3u * 4096);
  EXPECT_EQ(static_cast<unsigned char*>(reader->data())[4097], 0x5a);

  auto again = ShmSegment::Create(o);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(ShmSegment::Remove(name).ok());
  EXPECT_FALSE(ShmSegment::Exists(name));
  EXPECT_TRUE(ShmSegment::Remove(name).ok());  // idempotent
}

// ReleasePages: a range outside the segment is refused naming it; only whole pages inside the
// range go back (they read as zeros), the partial pages at its ends keep their bytes.
TEST(ShmSegmentTest, ReleasePagesRefusesOutOfRangeAndKeepsPartialPages) {
  const std::string name = "slidedp." + UniqueInstance("release");
  ShmSegment::CreateOptions o;
  o.name = name;
  o.size_bytes = 4 * 4096;
  auto seg = ShmSegment::Create(o);
  ASSERT_TRUE(seg.ok()) << seg.status();
  seg->set_remove_on_destroy(true);
  std::memset(seg->data(), 0x5a, seg->size_bytes());
  auto bad = seg->ReleasePages(3 * 4096, 2 * 4096);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find(name), std::string::npos) << bad.status();
  auto released = seg->ReleasePages(100, 2 * 4096);  // [100, 8292): only page 1 is whole
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, 4096u);
  const auto* b = static_cast<const unsigned char*>(seg->data());
  EXPECT_EQ(b[4095], 0x5a);
  EXPECT_EQ(b[4096], 0);
  EXPECT_EQ(b[2 * 4096 - 1], 0);
  EXPECT_EQ(b[2 * 4096], 0x5a);
  EXPECT_EQ(*seg->ReleasePages(10, 20), 0u);  // no whole page inside
}

TEST(ShmSegmentTest, GroupModeAndParallelPopulate) {
  auto pool = ThreadPool::Create({.num_threads = 2});
  ASSERT_TRUE(pool.ok());
  ShmSegment::CreateOptions o;
  o.name = "slidedp." + UniqueInstance("seg660");
  o.size_bytes = 64 * 4096;
  o.mode = 0660;
  o.populate_pool = pool->get();
  o.mlock = MlockPolicy::kOff;
  auto seg = ShmSegment::Create(o);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_FALSE(seg->locked());
  struct stat st;
  ASSERT_EQ(stat(("/dev/shm/" + o.name).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  // Populated pages are counted in the file's blocks.
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, o.size_bytes);
  seg->set_remove_on_destroy(true);
}

TEST(ShmSegmentTest, NumaBindingToNodeZero) {
  ShmSegment::CreateOptions o;
  o.name = "slidedp." + UniqueInstance("numa");
  o.size_bytes = 16 * 4096;
  o.numa_node = 0;
  auto seg = ShmSegment::Create(o);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_EQ(seg->numa_node(), 0);
  seg->set_remove_on_destroy(true);
}

TEST(ShmSegmentTest, TooLargeIsResourceExhaustedNamingBytes) {
  ShmSegment::CreateOptions o;
  o.name = "slidedp." + UniqueInstance("huge");
  o.size_bytes = size_t{1} << 50;  // 1 PiB
  auto seg = ShmSegment::Create(o);
  ASSERT_FALSE(seg.ok());
  EXPECT_EQ(seg.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(seg.status().message().find("1125899906842624 bytes"), std::string::npos)
      << seg.status();
  EXPECT_FALSE(ShmSegment::Exists(o.name));  // nothing left behind
}

TEST(ShmSegmentTest, BadNamesAndMissingSegments) {
  ShmSegment::CreateOptions o;
  o.name = "has/slash";
  o.size_bytes = 4096;
  EXPECT_EQ(ShmSegment::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.name = "slidedp." + UniqueInstance("zero");
  o.size_bytes = 0;
  EXPECT_EQ(ShmSegment::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  auto missing = ShmSegment::Open("slidedp." + UniqueInstance("absent"), false);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
}

#if defined(__SANITIZE_THREAD__)
constexpr bool kTsan = true;
#else
constexpr bool kTsan = false;
#endif

// A segment opened again in the creating process: under TSan the same mapping (read-only asked,
// read-write given), which outlives its creator and is unmapped by its last owner; a file made
// anew under the same name is another mapping. Elsewhere a mapping of its own. Either way the
// readers see the creator's writes after it is gone. Under TSan the last part orders a plain
// heap write through a flag stored through one owner and loaded through another: with two
// mappings of the flag TSan saw no order and reported the heap read as a race.
TEST(ShmSegmentTest, OpenInTheCreatingProcessSharesOneMappingUnderTsan) {
  ShmSegment::CreateOptions o;
  o.name = "slidedp." + UniqueInstance("alias");
  o.size_bytes = 2 * 4096;
  o.mlock = MlockPolicy::kOff;
  auto created = ShmSegment::Create(o);
  ASSERT_TRUE(created.ok()) << created.status();
  std::optional<ShmSegment> creator(std::move(*created));
  creator->set_remove_on_destroy(true);
  std::memset(creator->data(), 0x11, creator->size_bytes());
  auto writer = ShmSegment::Open(o.name, /*writable=*/true);
  auto reader = ShmSegment::Open(o.name, /*writable=*/false);
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(writer->data() == creator->data(), kTsan);
  EXPECT_EQ(reader->data() == creator->data(), kTsan);
  creator.reset();  // removes the name; the others keep the file mapped
  EXPECT_FALSE(ShmSegment::Exists(o.name));
  EXPECT_EQ(static_cast<const unsigned char*>(reader->data())[4096], 0x11);
  static_cast<unsigned char*>(writer->data())[4096] = 0x22;
  EXPECT_EQ(static_cast<const unsigned char*>(reader->data())[4096], 0x22);

  auto fresh = ShmSegment::Create(o);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  fresh->set_remove_on_destroy(true);
  auto fresh_reader = ShmSegment::Open(o.name, /*writable=*/true);
  ASSERT_TRUE(fresh_reader.ok()) << fresh_reader.status();
  EXPECT_EQ(fresh_reader->data() == fresh->data(), kTsan);
  EXPECT_NE(fresh_reader->data(), writer->data());
  EXPECT_EQ(static_cast<const unsigned char*>(fresh_reader->data())[4096], 0);

  int message = 0;
  auto* flag = fresh->at<uint64_t>(0);
  std::thread t([&] {
    message = 42;
    std::atomic_ref<uint64_t>(*flag).store(1, std::memory_order_release);
  });
  auto* seen = fresh_reader->at<uint64_t>(0);
  while (std::atomic_ref<uint64_t>(*seen).load(std::memory_order_acquire) != 1) {
    std::this_thread::yield();
  }
  EXPECT_EQ(message, 42);
  t.join();
}

// A segment hostd takes over must be its own: Open (with a check) and Remove (with a check) refuse,
// on the opened file, a wider mode, another group when group-accessible, another user's file
// (root only: chown) and a link (never followed), naming the file, its owner and mode, what was
// expected and what to do; nothing is mapped or removed then.
TEST(ShmSegmentTest, CheckedOpenAndRemoveRefuseWhatIsNotOurs) {
  const std::string name = "slidedp." + UniqueInstance("owned");
  const std::string path = "/dev/shm/" + name;
  const std::string target = path + ".target";
  struct Janitor {
    std::vector<std::string> paths;
    ~Janitor() {
      for (const std::string& p : paths) unlink(p.c_str());
    }
  } janitor{{path, target}};
  ShmSegment::CreateOptions o;
  o.name = name;
  o.size_bytes = 4096;
  o.mlock = MlockPolicy::kOff;
  ASSERT_TRUE(ShmSegment::Create(o).ok());
  auto refused = [&](const OwnerCheck& check, const std::vector<std::string>& parts) {
    auto opened = ShmSegment::Open(name, /*writable=*/true, check);
    ASSERT_FALSE(opened.ok());
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition) << opened.status();
    const std::string msg(opened.status().message());
    for (const std::string& part : parts) {
      EXPECT_NE(msg.find(part), std::string::npos) << "no '" << part << "' in: " << msg;
    }
    absl::Status removed = ShmSegment::Remove(name, check);
    EXPECT_EQ(removed.code(), absl::StatusCode::kFailedPrecondition) << removed;
    EXPECT_EQ(removed.message(), opened.status().message());
    EXPECT_TRUE(ShmSegment::Exists(name));
  };
  ASSERT_TRUE(ShmSegment::Open(name, true, OwnedBySelf(0600)).ok());
  ASSERT_TRUE(ShmSegment::CheckExisting(name, OwnedBySelf(0600)).ok());

  ASSERT_EQ(chmod(path.c_str(), 0666), 0);
  refused(OwnedBySelf(0660),
          {"segment " + path + " is a regular file owned by " + DescribeUid(geteuid()),
           "mode 0666; expected a regular file owned by " + DescribeUid(geteuid()) +
               ", mode 0660 or narrower",
           "check who created it", "rm " + path + ")"});
  ASSERT_EQ(chmod(path.c_str(), 0660), 0);
  EXPECT_TRUE(ShmSegment::Open(name, true, OwnedBySelf(0660)).ok());
  refused(OwnedBySelf(0600), {"mode 0660", "mode 0600 or narrower"});
  if (geteuid() == 0) {
    // Group-accessible in a group other than the configured one.
    ASSERT_EQ(chown(path.c_str(), 0, 65534), 0);
    refused(OwnedBySelf(0660, 0), {"group gid 65534", "group gid 0 (root) when group-accessible"});
    EXPECT_TRUE(ShmSegment::Open(name, true, OwnedBySelf(0660, 65534)).ok());
    ASSERT_EQ(chown(path.c_str(), 65534, 65534), 0);
    refused(OwnedBySelf(0660, 65534), {"owned by uid 65534 (nobody)", "owned by uid 0 (root)"});
    // What root's cleanup accepts: anyone's regular file.
    EXPECT_TRUE(
        ShmSegment::CheckExisting(name, {OwnerCheck::kAnyUid, 07777, OwnerCheck::kAnyGid}).ok());
    ASSERT_EQ(chown(path.c_str(), 0, 0), 0);
  }
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  // A link to a file of ours: neither followed nor removed; the target keeps its bytes.
  ASSERT_EQ(rename(path.c_str(), target.c_str()), 0);
  ASSERT_EQ(symlink(target.c_str(), path.c_str()), 0);
  refused(OwnedBySelf(0600), {"segment " + path + " is a symbolic link"});
  struct stat st;
  ASSERT_EQ(stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 4096);
  ASSERT_EQ(unlink(path.c_str()), 0);
  ASSERT_EQ(rename(target.c_str(), path.c_str()), 0);

  EXPECT_TRUE(ShmSegment::Remove(name, OwnedBySelf(0600)).ok());
  EXPECT_FALSE(ShmSegment::Exists(name));
  EXPECT_TRUE(ShmSegment::Remove(name, OwnedBySelf(0600)).ok());  // absent: OK
  EXPECT_EQ(ShmSegment::Open(name, true, OwnedBySelf(0600)).status().code(),
            absl::StatusCode::kNotFound);
}

// The group is set before the mode: 0660 never applies to the creator's own group.
TEST(ShmSegmentTest, CreateGivesTheGroupAndExactMode) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give a file a group it is not in";
  ShmSegment::CreateOptions o;
  o.name = "slidedp." + UniqueInstance("grp");
  o.size_bytes = 4096;
  o.mode = 0660;
  o.group = 65534;
  o.mlock = MlockPolicy::kOff;
  auto seg = ShmSegment::Create(o);
  ASSERT_TRUE(seg.ok()) << seg.status();
  seg->set_remove_on_destroy(true);
  struct stat st;
  ASSERT_EQ(stat(("/dev/shm/" + o.name).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0660u);
  EXPECT_EQ(st.st_gid, 65534u);
}

TEST(ShmSegmentTest, HostMemoryInfoIsPlausible) {
  auto info = ReadHostMemoryInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_GT(info->shm_free_bytes, 0u);
  EXPECT_GT(info->mem_available_bytes, 0u);
  EXPECT_GT(info->memlock_limit_bytes, 0u);
}

}  // namespace
}  // namespace slidedp
