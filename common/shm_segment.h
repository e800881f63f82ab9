// ShmSegment: a named POSIX shared-memory segment created and owned by hostd (or opened by a
// reader) through Boost.Interprocess, with the placement hostd needs for training state:
//   - checked first: /dev/shm free space, MemAvailable and the memlock limit, each failing with
//     RESOURCE_EXHAUSTED naming the bytes needed and the bytes available;
//   - created with exact size and permissions (0600, or 0660 plus a group);
//   - NUMA-bound (mbind MPOL_BIND on the mapping) before any page is touched;
//   - populated in parallel (MADV_POPULATE_WRITE per thread range), so a short /dev/shm shows up
//     here as an error and never later as SIGBUS;
//   - mlocked (required, best effort, or off).
// The object is a move-only owner of the mapping: the destructor unmaps (and unlocks). Removing
// the name is explicit (Remove / set_remove_on_destroy) because hostd may leave segments behind on
// purpose for re-adoption after a crash.
//
// Under ThreadSanitizer (a -fsanitize=thread build only) a process maps each shared-memory file
// once: Open of a file this process already maps (hostd's engine and an in-process RankClient in
// a test) returns that mapping, shared and reference counted, read-write if it already is. TSan
// keys its state by virtual address, so two mappings of one word would be two unrelated words to
// it, and a release through one and an acquire through the other would order nothing.
//
// Thread safety: a ShmSegment is confined to its owner; the memory it maps is shared and its
// users synchronize through the atomics of proto/shm_abi.h.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace slidedp {
class ThreadPool;
}

namespace slidedp {

enum class MlockPolicy { kRequired, kBestEffort, kOff };

class ShmSegment {
 public:
  struct CreateOptions {
    std::string name;  // without leading '/', e.g. "slidedp.default.state"
    size_t size_bytes = 0;
    int numa_node = -1;  // -1: no binding
    mode_t mode = 0600;
    gid_t group = static_cast<gid_t>(-1);  // with mode 0660
    MlockPolicy mlock = MlockPolicy::kRequired;
    ThreadPool* populate_pool = nullptr;  // null: populate on the calling thread
  };

  // ALREADY_EXISTS if the name is taken, RESOURCE_EXHAUSTED when memory, /dev/shm or memlock is
  // short (message names the bytes), INVALID_ARGUMENT for a bad name or size.
  static absl::StatusOr<ShmSegment> Create(const CreateOptions& options);
  // Maps an existing segment; NOT_FOUND when absent, PERMISSION_DENIED when not ours to open.
  static absl::StatusOr<ShmSegment> Open(const std::string& name, bool writable);
  // Locks an opened mapping in RAM (a re-adopted segment): RESOURCE_EXHAUSTED when `policy` is
  // kRequired and mlock fails; kBestEffort leaves it unlocked then.
  absl::Status Lock(MlockPolicy policy);
  // Removes the name (mappings stay valid). OK if it did not exist.
  static absl::Status Remove(const std::string& name);
  static bool Exists(const std::string& name);

  ShmSegment() = default;
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  void* data() const { return data_; }
  template <typename T>
  T* at(size_t offset_bytes) const {
    return reinterpret_cast<T*>(static_cast<char*>(data_) + offset_bytes);
  }
  size_t size_bytes() const { return size_bytes_; }
  const std::string& name() const { return name_; }
  bool locked() const { return locked_; }
  int numa_node() const { return numa_node_; }
  void set_remove_on_destroy(bool remove) { remove_on_destroy_ = remove; }
  // Gives the whole pages inside [offset, offset + bytes) back to the system (unlocked first):
  // they read as zeros afterwards and take memory again only when written. Returns the bytes
  // released. INVALID_ARGUMENT when the range is outside the segment.
  absl::StatusOr<size_t> ReleasePages(size_t offset, size_t bytes);

 private:
  void Reset();

  std::string name_;
  void* data_ = nullptr;
  size_t size_bytes_ = 0;
  bool locked_ = false;
  int numa_node_ = -1;
  bool remove_on_destroy_ = false;
};

// Free bytes of the filesystem behind /dev/shm, MemAvailable, and whether this process may lock
// `bytes` more (CAP_IPC_LOCK or RLIMIT_MEMLOCK). Exposed for `slidedpctl doctor`/estimate later.
struct HostMemoryInfo {
  uint64_t shm_free_bytes = 0;
  uint64_t mem_available_bytes = 0;
  uint64_t memlock_limit_bytes = 0;  // UINT64_MAX: unlimited or CAP_IPC_LOCK
};
absl::StatusOr<HostMemoryInfo> ReadHostMemoryInfo();

}  // namespace slidedp
