// The files a hostd instance keeps in /dev/shm, and the lock that says whether a live hostd owns
// them:
//   slidedp.<instance>.{control,state,params,grads}   the named segments (see hostd/state.h)
//   slidedp.<instance>.lock                           flock'ed by the owning hostd; holds its pid
// The lock is an advisory flock(2) held for the whole life of the owner, so the kernel drops it
// when the owner dies, kill -9 included; the pid text in the file is for messages only. A segment
// whose lock nobody holds is stale: a restarted hostd may re-adopt it (hostd/recovery.h) and
// `slidedpctl cleanup` may remove it. A live owner's files are never adopted or removed.
//
// Nor are another user's: every file is checked on its opened descriptor before it is locked,
// rewritten or removed (OwnerCheck, common/shm_segment.h): a regular file (links are never
// followed), owned by the expected user, no wider mode than configured.
//
// Thread safety: the functions are thread-safe; an InstanceLock is confined to its owner.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/shm_segment.h"
#include "common/unique_fd.h"

namespace slidedp {

inline constexpr char kShmDir[] = "/dev/shm";

// "/dev/shm/slidedp.<instance>.lock".
std::string InstanceLockPath(const std::string& instance);

// The gid of `shm_group`: a group name, or the number of an existing group; -1 for "" (the
// instance's files keep the process's group). INVALID_ARGUMENT naming shm_group and the value
// when there is no such group.
absl::StatusOr<gid_t> ResolveShmGroup(const std::string& shm_group);

class InstanceLock {
 public:
  struct Options {
    mode_t mode = 0600;                    // the lock file's mode: shm_mode (0600 or 0660)
    gid_t group = static_cast<gid_t>(-1);  // its group (shm_group) with 0660; -1: the process's
    // What an existing lock file must be; unset: OwnedBySelf(mode, group).
    std::optional<OwnerCheck> check;
  };
  // Takes the instance's lock (creating the file, never following a link), gives the file
  // `options`' group and mode and writes this process's pid into it. FAILED_PRECONDITION
  // "instance 'X' is in use by hostd pid N (...)" when a live process holds it, CheckOwner's
  // FAILED_PRECONDITION when the existing file fails the check, whoever holds
  // it; INVALID_ARGUMENT for a bad instance name.
  static absl::StatusOr<std::unique_ptr<InstanceLock>> Acquire(const std::string& instance,
                                                               const Options& options);
  static absl::StatusOr<std::unique_ptr<InstanceLock>> Acquire(const std::string& instance) {
    return Acquire(instance, Options{});
  }
  // Removes the lock file, then releases the lock.
  ~InstanceLock();
  InstanceLock(const InstanceLock&) = delete;
  InstanceLock& operator=(const InstanceLock&) = delete;

  const std::string& instance() const { return instance_; }
  // The access the instance's files get (Options::mode, Options::group), for the segments.
  mode_t mode() const { return mode_; }
  gid_t group() const { return group_; }

 private:
  InstanceLock(std::string instance, UniqueFd fd, mode_t mode, gid_t group)
      : instance_(std::move(instance)), fd_(std::move(fd)), mode_(mode), group_(group) {}
  std::string instance_;
  UniqueFd fd_;  // holds the flock
  mode_t mode_ = 0600;
  gid_t group_ = static_cast<gid_t>(-1);
};

// The pid of the live process that holds the instance's lock, 0 when nobody holds it (or there
// is no lock file). The pid is the one written in the file (0 if unreadable, then -1 is returned
// to still say "held").
pid_t InstanceLockHolder(const std::string& instance);

struct InstanceFile {
  std::string name;  // in /dev/shm
  uint64_t bytes = 0;
  // lstat's owner, group and st_mode (type and permission bits) when listed.
  uid_t uid = 0;
  gid_t gid = 0;
  mode_t mode = 0;
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

// What `slidedpctl cleanup` requires of the files it removes. Its user's own files, of any mode
// (it reads none of them as state); run as root (euid 0), anyone's: root cleaning up after a
// service user is legitimate. A link or anything but a regular file is never removed.
OwnerCheck CleanupOwnerCheck();

// Removes the stale files of `instance`: takes its lock first (FAILED_PRECONDITION naming the pid
// when a live hostd holds it or its control segment names a live hostd), checks every file
// against `check` (CheckOwner's FAILED_PRECONDITION naming the first that fails; no segment is
// removed, the lock file it took goes), removes the segments, then the lock file. Returns what was
// removed.
absl::StatusOr<InstanceFiles> RemoveStaleInstance(const std::string& instance,
                                                  const OwnerCheck& check);

}  // namespace slidedp
