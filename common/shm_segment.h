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
// /dev/shm is writable by every local user, so a file there bearing an instance's name is not
// hostd's merely because of its name. Before hostd adopts, rewrites or removes an existing file it
// checks it (OwnerCheck, on the opened descriptor: no check-then-use race): a regular file (a
// symbolic link is never followed), owned by hostd's effective uid, with no permission bit wider
// than hostd would have given it. The name cannot be swapped between that check and the use:
// /dev/shm is sticky, so only the file's owner or root may rename or remove a file in it.
//
// Thread safety: a ShmSegment is confined to its owner; the memory it maps is shared and its
// users synchronize through the atomics of proto/shm_abi.h.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace slidedp {
class ThreadPool;
}

namespace slidedp {

enum class MlockPolicy { kRequired, kBestEffort, kOff };

// What an existing file must be before it is adopted, rewritten or removed (see above).
struct OwnerCheck {
  static constexpr uid_t kAnyUid = static_cast<uid_t>(-1);
  static constexpr gid_t kAnyGid = static_cast<gid_t>(-1);
  uid_t uid = kAnyUid;     // the owner it must have
  mode_t max_mode = 0600;  // no permission bit outside these (07777: any mode)
  gid_t gid = kAnyGid;     // the group it must have when its mode has group bits
};
// This process's own file: owner geteuid(), mode within `max_mode`, and with group bits the group
// `group` (-1: getegid(), the group a file gets without fchown).
OwnerCheck OwnedBySelf(mode_t max_mode, gid_t group = static_cast<gid_t>(-1));

// OK when `st` (fstat of the opened `path`, or lstat when it could not be opened) meets `want`.
// Otherwise FAILED_PRECONDITION naming `what` ("segment", "lock file"), the path, the file's
// type, owner (uid and user name), group and mode, what was expected, and what to do.
absl::Status CheckOwner(const struct stat& st, const std::string& path, absl::string_view what,
                        const OwnerCheck& want);
// Checks what `path` names without following a link: false when nothing is there, true when it
// passes `check`, CheckOwner's refusal otherwise.
absl::StatusOr<bool> CheckPath(const std::string& path, absl::string_view what,
                               const OwnerCheck& check);
// "uid 65534 (nobody)" / "gid 0 (root)"; without the name when the id has none.
std::string DescribeUid(uid_t uid);
std::string DescribeGid(gid_t gid);

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
  // The same for a segment hostd takes over (re-adoption): opened without following a symbolic
  // link and mapped only when the opened file passes `check` (CheckOwner's FAILED_PRECONDITION
  // otherwise, nothing mapped).
  static absl::StatusOr<ShmSegment> Open(const std::string& name, bool writable,
                                         const OwnerCheck& check);
  // OK, or CheckOwner's refusal when `name` exists and fails `check`; a link is not followed.
  static absl::Status CheckExisting(const std::string& name, const OwnerCheck& check);
  // Locks an opened mapping in RAM (a re-adopted segment): RESOURCE_EXHAUSTED when `policy` is
  // kRequired and mlock fails; kBestEffort leaves it unlocked then.
  absl::Status Lock(MlockPolicy policy);
  // Removes the name (mappings stay valid). OK if it did not exist.
  static absl::Status Remove(const std::string& name);
  // Removes the name only when what it names passes `check` (CheckOwner's refusal otherwise,
  // nothing removed). OK if it did not exist.
  static absl::Status Remove(const std::string& name, const OwnerCheck& check);
  // Whether the name exists (a symbolic link counts, even a dangling one).
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
