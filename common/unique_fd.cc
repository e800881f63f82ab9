#include "common/unique_fd.h"

#include <cerrno>

#include "absl/strings/str_cat.h"

namespace slidedp {

absl::Status UniqueFd::Close(absl::string_view what) {
  const int fd = release();
  if (fd >= 0 && ::close(fd) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("close ", what));
  return absl::OkStatus();
}

}  // namespace slidedp
