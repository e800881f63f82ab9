#include "common/mapping.h"

#include <sys/mman.h>

#include <cerrno>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace slidedp {

absl::StatusOr<Mapping> Mapping::Map(size_t size_bytes, int prot, int flags, int fd, off_t offset,
                                     absl::string_view what) {
  if (size_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": mmap of 0 bytes; expected a size > 0"));
  }
  void* p = mmap(nullptr, size_bytes, prot, flags, fd, offset);
  if (p == MAP_FAILED) {
    return absl::ErrnoToStatus(errno, absl::StrCat(what, ": mmap of ", size_bytes, " bytes"));
  }
  return Mapping(p, size_bytes);
}

absl::StatusOr<Mapping> Mapping::Anonymous(size_t size_bytes, absl::string_view what) {
  return Map(size_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, what);
}

Mapping::Mapping(Mapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void Mapping::reset() noexcept {
  if (data_ != nullptr) static_cast<void>(munmap(data_, size_));
  data_ = nullptr;
  size_ = 0;
}

}  // namespace slidedp
