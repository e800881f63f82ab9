// The files a hostd instance keeps in /dev/shm, and the lock that says whether a live hostd owns
// them:
//   slidedp.<instance>.{control,state,params,grads}   the named segments (see hostd/state.h)
//   slidedp.<instance>.lock                           flock'ed by the owning hostd; holds its pid
// The lock is an advisory flock(2) held for the whole life of the owner, so the kernel drops it
// when the owner dies, kill -9 included; the pid text in the file is for messages only. A segment
// whose lock nobody holds is stale: a restarted hostd may re-adopt it (hostd/recovery.h) and
// `slidedpctl cleanup` may remove it. A live owner's files are never adopted or removed.
//
// Thread safety: the functions are thread-safe; an InstanceLock is confined to its owner.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace slidedp {

inline constexpr char kShmDir[] = "/dev/shm";

// "/dev/shm/slidedp.<instance>.lock".
std::string InstanceLockPath(const std::string& instance);

class InstanceLock {
 public:
  // Takes the instance's lock (creating the file, mode 0600) and writes this process's pid into
  // it. FAILED_PRECONDITION "instance 'X' is in use by hostd pid N (...)" when a live process
  // holds it; INVALID_ARGUMENT for a bad instance name.
  static absl::StatusOr<std::unique_ptr<InstanceLock>> Acquire(const std::string& instance);
  // Removes the lock file, then releases the lock.
  ~InstanceLock();
  InstanceLock(const InstanceLock&) = delete;
  InstanceLock& operator=(const InstanceLock&) = delete;

  const std::string& instance() const { return instance_; }

 private:
  InstanceLock(std::string instance, int fd) : instance_(std::move(instance)), fd_(fd) {}
  std::string instance_;
  int fd_ = -1;
};

// The pid of the live process that holds the instance's lock, 0 when nobody holds it (or there
// is no lock file). The pid is the one written in the file (0 if unreadable, then -1 is returned
// to still say "held").
pid_t InstanceLockHolder(const std::string& instance);

struct InstanceFile {
  std::string name;  // in /dev/shm
  uint64_t bytes = 0;
};

struct InstanceFiles {
  std::string instance;
  std::vector<InstanceFile> files;  // sorted by name
  uint64_t bytes = 0;
  // Live owner: the lock holder, or (no lock held) a live hostd_pid recorded in the control
  // segment of a hostd that predates the lock file. 0: nobody, the files are stale.
  pid_t live_pid = 0;
};

// Every instance with files in `dir` (slidedp.<instance>.<kind> and .lock), sorted by instance;
// only `instance` when it is non-empty.
absl::StatusOr<std::vector<InstanceFiles>> ListInstanceFiles(const std::string& instance = "",
                                                             const std::string& dir = kShmDir);

// Removes the stale files of `instance`: takes its lock first (FAILED_PRECONDITION naming the pid
// when a live hostd holds it or its control segment names a live hostd), removes the segments,
// then the lock file. Returns what was removed.
absl::StatusOr<InstanceFiles> RemoveStaleInstance(const std::string& instance);

}  // namespace slidedp
