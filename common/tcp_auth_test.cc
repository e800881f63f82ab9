#include "common/tcp_auth.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace slidedp {
namespace {

TEST(TcpAuthTest, LoopbackIsExact) {
  for (const char* ok : {"127.0.0.1:7070", "127.1.2.3:1", "localhost:65535", "[::1]:80"}) {
    EXPECT_TRUE(IsLoopbackHostPort(ok, false)) << ok;
  }
  EXPECT_TRUE(IsLoopbackHostPort("127.0.0.1:0", true));
  EXPECT_FALSE(IsLoopbackHostPort("127.0.0.1:0", false));
  // The service's old check was a prefix match: each of these passed it.
  for (const char* bad : {"127.0.0.1.nip.io:80", "127.evil.example:80", "localhost.example:80",
                          "127.0.0.256:80", "127.0.0:80", "0.0.0.0:80", "[::]:80", "127.0.0.1",
                          "127.0.0.1:65536", "127.0.0.1:x", "127.0.0.1:", ":80"}) {
    EXPECT_FALSE(IsLoopbackHostPort(bad, true)) << bad;
  }
}

class TokenFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("tcp-auth-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text, mode_t mode) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << text;
    EXPECT_EQ(chmod(path.c_str(), mode), 0);
    return path;
  }
  std::filesystem::path dir_;
};

TEST_F(TokenFileTest, ReadsTheFirstLineOfAPrivateFile) {
  const std::string token(64, 'a');
  const std::string path = Write("token", token + "\nignored\n", 0640);
  auto got = ReadServiceToken(path, /*for_server=*/true);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, token);
  EXPECT_TRUE(BearerMatches("Bearer " + token, token));
  EXPECT_FALSE(BearerMatches("Bearer " + token + "x", token));
  EXPECT_FALSE(BearerMatches("Bearer " + std::string(63, 'a') + "b", token));
  EXPECT_FALSE(BearerMatches(token, token));
  EXPECT_FALSE(BearerMatches("", token));
}

TEST_F(TokenFileTest, TheServerRefusesAFileOthersCanReadALinkOrAShortToken) {
  const std::string token(40, 'k');
  const std::string open_file = Write("open", token, 0644);
  auto s = ReadServiceToken(open_file, /*for_server=*/true);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("mode 0644"), std::string::npos) << s.status();
  EXPECT_TRUE(ReadServiceToken(open_file, /*for_server=*/false).ok());  // a client may read it

  const std::string link = (dir_ / "link").string();
  ASSERT_EQ(symlink(Write("target", token, 0600).c_str(), link.c_str()), 0);
  EXPECT_EQ(ReadServiceToken(link, true).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReadServiceToken(link, false).status().code(), absl::StatusCode::kFailedPrecondition);

  auto short_token = ReadServiceToken(Write("short", "abc\n", 0600), true);
  EXPECT_EQ(short_token.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(short_token.status().message().find("32 to 4096"), std::string::npos);
  auto spaces = ReadServiceToken(
      Write("spaces", std::string(20, 'a') + " " + std::string(20, 'b'), 0600), true);
  EXPECT_EQ(spaces.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReadServiceToken((dir_ / "missing").string(), true).status().code(),
            absl::StatusCode::kNotFound);
  if (geteuid() == 0) {
    const std::string foreign = Write("foreign", token, 0600);
    ASSERT_EQ(chown(foreign.c_str(), 65534, 65534), 0);
    auto f = ReadServiceToken(foreign, true);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(f.status().message().find("uid 65534"), std::string::npos) << f.status();
  }
}

}  // namespace
}  // namespace slidedp
