// Mapping: the move-only owner of one mmap()ed range.
//
// Map and Anonymous return the mapping or errno's status with the caller's context; the
// destructor (and reset) munmaps it. Nothing here throws. ShmSegment (shm_segment.h) keeps its
// own mapping because a TSan build shares one mapping among several segments of one file.
//
// Thread safety: a Mapping is confined to its owner; the memory it maps is shared only as its
// users arrange.
#pragma once

#include <sys/types.h>

#include <cstddef>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace slidedp {

class Mapping {
 public:
  // mmap(nullptr, size_bytes, prot, flags, fd, offset). INVALID_ARGUMENT when size_bytes is 0;
  // mmap's errno as a status ("<what>: mmap of <n> bytes: <strerror>") when it fails.
  static absl::StatusOr<Mapping> Map(size_t size_bytes, int prot, int flags, int fd, off_t offset,
                                     absl::string_view what);
  // Private anonymous read-write memory, zero-filled (pages are faulted in on first touch).
  // Errors as Map's.
  static absl::StatusOr<Mapping> Anonymous(size_t size_bytes, absl::string_view what);

  Mapping() noexcept = default;
  Mapping(Mapping&& other) noexcept;
  Mapping& operator=(Mapping&& other) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { reset(); }

  // The start of the range (nullptr when nothing is mapped) and its length.
  void* data() const noexcept { return data_; }
  template <typename T>
  T* as() const noexcept {
    return static_cast<T*>(data_);
  }
  size_t size() const noexcept { return size_; }
  bool valid() const noexcept { return data_ != nullptr; }
  // Unmaps the range now (munmap's error, which only a range never mapped could cause, is
  // ignored); nothing is mapped afterwards.
  void reset() noexcept;

 private:
  Mapping(void* data, size_t size) noexcept : data_(data), size_(size) {}

  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace slidedp
