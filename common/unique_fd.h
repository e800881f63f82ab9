// UniqueFd: the move-only owner of one POSIX file descriptor.
//
// The destructor (and reset) closes the descriptor and ignores close()'s result: on Linux the
// descriptor is released even when close() fails, EINTR included, so a retry could close a
// descriptor another thread has just been given. Where a close error means lost data (a file
// written and fsynced), call Close(), which reports it. Nothing here throws.
//
// Thread safety: a UniqueFd is confined to its owner, like the descriptor it holds.
#pragma once

#include <unistd.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace slidedp {

class UniqueFd {
 public:
  UniqueFd() noexcept = default;
  // Takes ownership of `fd` (a negative value: nothing owned, e.g. a failed open()).
  explicit UniqueFd(int fd) noexcept : fd_(fd < 0 ? -1 : fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  // The descriptor, or -1 when none is owned.
  int get() const noexcept { return fd_; }
  bool valid() const noexcept { return fd_ >= 0; }
  // Gives up ownership without closing: returns the descriptor (-1 when none) for the caller to
  // close.
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }
  // Closes the owned descriptor (its error ignored, see above) and owns `fd` instead.
  void reset(int fd = -1) noexcept {
    const int old = std::exchange(fd_, fd < 0 ? -1 : fd);
    if (old >= 0 && old != fd_) static_cast<void>(::close(old));
  }
  // Closes the descriptor now and reports a failure as errno's status "close <what>: <strerror>"
  // (a write-back error of a file written through it). OK when none is owned. Either way none
  // is owned afterwards.
  absl::Status Close(absl::string_view what);

 private:
  int fd_ = -1;
};

}  // namespace slidedp
