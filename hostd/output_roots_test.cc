#include "hostd/output_roots.h"

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace slidedp::hostd {
namespace {

namespace fs = std::filesystem;

class OutputRootsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/slidedp-roots-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    tmp_ = tmpl;
    root_ = tmp_ + "/root";
    fs::create_directories(root_ + "/sub");
    fs::create_directories(tmp_ + "/outside");
    fs::create_symlink(tmp_ + "/outside", root_ + "/out-link");
    fs::create_symlink(root_ + "/sub", root_ + "/in-link");
    fs::create_symlink(root_, tmp_ + "/root-link");
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(tmp_, ec);
  }
  std::string tmp_;
  std::string root_;
};

void ExpectCode(const absl::Status& s, absl::StatusCode code, const std::string& fragment) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_NE(s.message().find(fragment), std::string::npos) << "'" << fragment << "' not in " << s;
}

TEST_F(OutputRootsTest, ExportOutDirStrictlyBelowARoot) {
  const std::vector<std::string> roots = {root_};
  auto ok = CheckExportOutDir(root_ + "/new", roots);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, root_ + "/new");
  ok = CheckExportOutDir(root_ + "/sub/deeper/x/", roots);  // missing parents are checked too
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, root_ + "/sub/deeper/x");
  // The parent is resolved, the last component kept (ExportHf refuses an out_dir that is a
  // symlink).
  ok = CheckExportOutDir(root_ + "/in-link/x", roots);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, root_ + "/sub/x");
  ok = CheckExportOutDir(root_ + "/in-link", roots);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, root_ + "/in-link");
  ok = CheckExportOutDir(root_ + "/sub/..", roots);  // the root itself
  EXPECT_EQ(ok.status().code(), absl::StatusCode::kPermissionDenied) << ok.status();
  // A root named through a symlink is its target.
  ok = CheckExportOutDir(root_ + "/new", {tmp_ + "/root-link"});
  ASSERT_TRUE(ok.ok()) << ok.status();

  for (const std::string& bad :
       {root_, root_ + "/", root_ + "/../outside/x", root_ + "/out-link", root_ + "/out-link/x",
        root_ + "x", root_ + "/sub/../../outside", std::string("/etc/slidedp-export"),
        tmp_ + "/root-link/../outside/y"}) {
    SCOPED_TRACE(bad);
    ExpectCode(CheckExportOutDir(bad, roots).status(), absl::StatusCode::kPermissionDenied,
               "out_dir: '" + bad + "'");
  }
  const absl::Status denied = CheckExportOutDir(root_ + "/out-link/x", roots).status();
  ExpectCode(
      denied, absl::StatusCode::kPermissionDenied,
      "(resolved: '" + tmp_ + "/outside/x') is not below one of output_roots (" + root_ + ")");
  ExpectCode(denied, absl::StatusCode::kPermissionDenied, "set output_roots in hostd's config");
  ExpectCode(CheckExportOutDir(tmp_ + "/x", {}).status(), absl::StatusCode::kPermissionDenied,
             "output_roots (none set)");
  ExpectCode(CheckExportOutDir("rel/x", roots).status(), absl::StatusCode::kInvalidArgument,
             "out_dir: expected an absolute path");
  ExpectCode(CheckExportOutDir("", roots).status(), absl::StatusCode::kInvalidArgument,
             "out_dir: expected an absolute path");
  // "/" allows any directory below it.
  ok = CheckExportOutDir(tmp_ + "/outside/x", {"/"});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(CheckExportOutDir("/", {"/"}).status().code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(OutputRootsTest, CheckpointDirIsCheckpointDirOrUnderARoot) {
  const std::string ckpt = tmp_ + "/ckpt";
  for (const std::string& good : {ckpt, ckpt + "/", ckpt + "/other", ckpt + "/a/../b"}) {
    SCOPED_TRACE(good);
    auto ok = CheckCheckpointDir(good, ckpt, {});
    EXPECT_TRUE(ok.ok()) << ok.status();
  }
  EXPECT_EQ(*CheckCheckpointDir(ckpt + "/a/../b", ckpt, {}), ckpt + "/b");
  auto ok = CheckCheckpointDir(root_, ckpt, {root_});  // a root itself
  ASSERT_TRUE(ok.ok()) << ok.status();
  ok = CheckCheckpointDir(root_ + "/in-link/c", "", {root_});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, root_ + "/sub/c");  // resolved: what is written is what was checked

  const absl::Status denied = CheckCheckpointDir(ckpt + "/../outside", ckpt, {root_}).status();
  ExpectCode(denied, absl::StatusCode::kPermissionDenied,
             "dir: '" + ckpt + "/../outside' (resolved: '" + tmp_ + "/outside')");
  ExpectCode(denied, absl::StatusCode::kPermissionDenied, "checkpoint.dir ('" + ckpt + "')");
  ExpectCode(denied, absl::StatusCode::kPermissionDenied, "output_roots (" + root_ + ")");
  ExpectCode(denied, absl::StatusCode::kPermissionDenied, "\"/\" allows any directory");
  ExpectCode(CheckCheckpointDir(root_ + "/out-link", ckpt, {root_}).status(),
             absl::StatusCode::kPermissionDenied, "(resolved: '" + tmp_ + "/outside')");
  ExpectCode(CheckCheckpointDir(ckpt + "x", ckpt, {}).status(), absl::StatusCode::kPermissionDenied,
             "checkpoint.dir");
  ExpectCode(CheckCheckpointDir(tmp_ + "/x", "", {}).status(), absl::StatusCode::kPermissionDenied,
             "checkpoint.dir (none set)");
  ExpectCode(CheckCheckpointDir("ckpt", ckpt, {"/"}).status(), absl::StatusCode::kInvalidArgument,
             "dir: expected an absolute path");
  ok = CheckCheckpointDir(tmp_ + "/outside", "", {"/"});
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST_F(OutputRootsTest, LongPathsAreRefusedWithABoundedMessage) {
  // A message quoting the whole path went back to the client in gRPC's trailers, which clients
  // cap at 8 KiB: the client saw RESOURCE_EXHAUSTED "received initial metadata size exceeds
  // limit" instead of the answer.
  const std::string long_dir = root_ + "/" + std::string(64 << 10, 'd');
  for (const absl::Status& s : {CheckCheckpointDir(long_dir, "", {root_}).status(),
                                CheckExportOutDir(long_dir, {root_}).status()}) {
    ExpectCode(s, absl::StatusCode::kInvalidArgument, "a path of 65");
    ExpectCode(s, absl::StatusCode::kInvalidArgument, "bytes; at most 4095");
    EXPECT_LT(s.message().size(), 2048u) << s.message().size();
  }
  const std::string relative(64 << 10, 'r');
  const absl::Status s = CheckExportOutDir(relative, {root_}).status();
  ExpectCode(s, absl::StatusCode::kInvalidArgument, "out_dir: expected an absolute path");
  EXPECT_LT(s.message().size(), 2048u);
  // Below PATH_MAX, a long path's message shows 1 KiB of it.
  const std::string outside = tmp_ + "/outside/" + std::string(200, 'o') + "/" +
                              std::string(200, 'o') + "/" + std::string(200, 'o') + "/" +
                              std::string(200, 'o') + "/" + std::string(200, 'o') + "/x";
  const absl::Status denied = CheckExportOutDir(outside, {root_}).status();
  ExpectCode(denied, absl::StatusCode::kPermissionDenied, "... (");
  EXPECT_LT(denied.message().size(), 2048u);
}

}  // namespace
}  // namespace slidedp::hostd
