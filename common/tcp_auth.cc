#include "common/tcp_auth.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/unique_fd.h"

namespace slidedp {
namespace {

absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

bool IsLoopbackIpv4(absl::string_view host) {
  std::vector<absl::string_view> parts = absl::StrSplit(host, '.');
  if (parts.size() != 4 || parts[0] != "127") return false;
  for (absl::string_view p : parts) {
    int v = 0;
    if (p.empty() || p.size() > 3 || !absl::ascii_isdigit(static_cast<unsigned char>(p[0])) ||
        !absl::SimpleAtoi(p, &v) || v < 0 || v > 255) {
      return false;
    }
  }
  return true;
}

std::string UserName(uid_t uid) {
  struct passwd pw;
  struct passwd* found = nullptr;
  char buf[1024];
  if (getpwuid_r(uid, &pw, buf, sizeof(buf), &found) == 0 && found != nullptr) {
    return found->pw_name;
  }
  return "?";
}

}  // namespace

bool IsLoopbackHostPort(std::string_view host_port, bool allow_port_zero) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string_view::npos) return false;
  const absl::string_view host = Av(host_port.substr(0, colon));
  const std::string_view port = host_port.substr(colon + 1);
  if (host != "localhost" && host != "[::1]" && !IsLoopbackIpv4(host)) return false;
  if (port.empty() || port.size() > 5) return false;
  uint32_t p = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), p);
  if (ec != std::errc() || end != port.data() + port.size() || p > 65535) return false;
  return p != 0 || allow_port_zero;
}

absl::StatusOr<std::string> ReadServiceToken(const std::string& path, bool for_server) {
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (!fd.valid()) {
    const int err = errno;
    const std::string what = absl::StrCat("auth token file ", path, ": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(what);
    if (err == EACCES) return absl::PermissionDeniedError(what);
    if (err == ELOOP) {
      return absl::FailedPreconditionError(
          absl::StrCat("auth token file ", path, " is a symbolic link; name the file itself"));
    }
    return absl::UnavailableError(what);
  }
  struct stat st;
  std::string text(kMaxTokenChars + 2, '\0');
  absl::Status status = absl::OkStatus();
  if (fstat(fd.get(), &st) != 0) {
    status = absl::UnavailableError(absl::StrCat("fstat ", path, ": ", std::strerror(errno)));
  } else if (!S_ISREG(st.st_mode)) {
    status = absl::FailedPreconditionError(
        absl::StrCat("auth token file ", path, " is not a regular file"));
  } else if (for_server && (st.st_uid != geteuid() || (st.st_mode & 0007) != 0)) {
    status = absl::FailedPreconditionError(absl::StrFormat(
        "auth token file %s is owned by uid %d (%s) with mode %04o; hostd (uid %d) needs it "
        "owned by itself and readable by nobody else than its user and group (chown, then "
        "chmod 0600 or 0640)",
        path, st.st_uid, UserName(st.st_uid), st.st_mode & 07777, geteuid()));
  }
  ssize_t n = 0;
  if (status.ok()) {
    n = read(fd.get(), text.data(), text.size());
    if (n < 0)
      status = absl::UnavailableError(absl::StrCat("read ", path, ": ", std::strerror(errno)));
  }
  fd.reset();
  if (!status.ok()) return status;
  text.resize(static_cast<size_t>(n));
  const size_t eol = text.find('\n');
  std::string token = text.substr(0, eol);
  if (!token.empty() && token.back() == '\r') token.pop_back();
  const bool printable =
      std::all_of(token.begin(), token.end(), [](char c) { return c > ' ' && c < 127; });
  if (token.size() < kMinTokenChars || token.size() > kMaxTokenChars || !printable) {
    return absl::FailedPreconditionError(absl::StrCat(
        "auth token file ", path, ": expected a first line of ", kMinTokenChars, " to ",
        kMaxTokenChars, " printable characters without spaces (e.g. `openssl rand -hex 32`), got ",
        token.size(), printable ? "" : " (with spaces or control characters)"));
  }
  return token;
}

std::string BearerValue(std::string_view token) { return absl::StrCat("Bearer ", Av(token)); }

bool BearerMatches(std::string_view presented, std::string_view token) {
  const std::string want = BearerValue(token);
  unsigned diff = presented.size() == want.size() ? 0u : 1u;
  for (size_t i = 0; i < want.size(); ++i) {
    const char p = i < presented.size() ? presented[i] : '\0';
    diff |= static_cast<unsigned char>(p ^ want[i]);
  }
  return diff == 0;
}

}  // namespace slidedp
