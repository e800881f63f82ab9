#include "common/instance_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/shm_segment.h"
#include "common/unique_fd.h"
#include "proto/shm_abi.h"

namespace slidedp {
namespace {

constexpr absl::string_view kPrefix = "slidedp.";
constexpr absl::string_view kSuffixes[] = {"control", "state", "params", "grads", "lock"};

absl::Status ErrnoError(const std::string& what, int err) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(err)));
}

bool ValidInstance(absl::string_view s) {
  if (s.empty() || s.size() > 32) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-';
  });
}

absl::Status CheckInstance(const std::string& instance) {
  if (ValidInstance(instance)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("instance: '", instance, "' is not 1 to 32 characters of [A-Za-z0-9_-]"));
}

pid_t ReadPid(int fd) {
  char buf[32] = {};
  const ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
  int pid = 0;
  if (n <= 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::string_view(buf, n)), &pid)) {
    return 0;
  }
  return pid;
}

// The hostd_pid a control segment records, when that process is alive (a hostd that predates the
// lock file); 0 otherwise.
pid_t LegacyLivePid(const std::string& instance) {
  // Anyone's, but a regular file: a FIFO in its place must not block the open.
  const OwnerCheck any_regular{OwnerCheck::kAnyUid, 07777, OwnerCheck::kAnyGid};
  auto seg = ShmSegment::Open(absl::StrCat(kPrefix, instance, ".control"), /*writable=*/false,
                              any_regular);
  if (!seg.ok() || seg->size_bytes() < shm::kRankSlotsOffset) return 0;
  const auto pid = static_cast<pid_t>(
      shm::Atomic(seg->at<shm::ControlBlock>(shm::kControlBlockOffset)->hostd_pid).load());
  if (pid > 0 && pid != getpid() && kill(pid, 0) == 0) return pid;
  return 0;
}

}  // namespace

std::string InstanceLockPath(const std::string& instance) {
  return absl::StrCat(kShmDir, "/", kPrefix, instance, ".lock");
}

absl::StatusOr<gid_t> ResolveShmGroup(const std::string& shm_group) {
  if (shm_group.empty()) return static_cast<gid_t>(-1);
  struct group gr;
  struct group* found = nullptr;
  std::vector<char> buf(16384);
  int err = getgrnam_r(shm_group.c_str(), &gr, buf.data(), buf.size(), &found);
  unsigned gid_number = 0;
  if (err == 0 && found == nullptr && absl::SimpleAtoi(shm_group, &gid_number)) {
    err = getgrgid_r(static_cast<gid_t>(gid_number), &gr, buf.data(), buf.size(), &found);
  }
  if (err != 0) return ErrnoError("shm_group: looking up group '" + shm_group + "'", err);
  if (found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm_group: group '", shm_group,
        "' does not exist; create it (groupadd) or set shm_group to an existing group (getent "
        "group lists them), or leave it empty for hostd's own group"));
  }
  return found->gr_gid;
}

absl::StatusOr<std::unique_ptr<InstanceLock>> InstanceLock::Acquire(const std::string& instance,
                                                                    const Options& options) {
  if (absl::Status s = CheckInstance(instance); !s.ok()) return s;
  const std::string path = InstanceLockPath(instance);
  const OwnerCheck check =
      options.check ? *options.check : OwnedBySelf(options.mode, options.group);
  // A previous owner unlinks the file before it unlocks, so the file we lock may be gone from
  // the directory by the time we hold it: then try again with the new one.
  for (int attempt = 0; attempt < 16; ++attempt) {
    // An existing file is opened without O_CREAT: in a sticky directory O_CREAT may refuse
    // another user's file (fs.protected_regular) before we could say whose it is.
    UniqueFd fd(open(path.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (!fd.valid() && errno == ENOENT) {
      fd.reset(open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
      if (!fd.valid() && errno == EEXIST) continue;  // made meanwhile: open that one
    }
    if (!fd.valid()) {
      const int err = errno;
      // A link (ELOOP) or another user's file (EACCES): say what is there.
      struct stat st;
      if (lstat(path.c_str(), &st) == 0) {
        if (absl::Status s = CheckOwner(st, path, "lock file", check); !s.ok()) return s;
      }
      return ErrnoError("open " + path, err);
    }
    struct stat held;
    if (fstat(fd.get(), &held) != 0) {
      const int err = errno;
      return ErrnoError("fstat " + path, err);
    }
    // Whoever holds it: a foreign file is refused as such, never taken for a live hostd's.
    if (absl::Status s = CheckOwner(held, path, "lock file", check); !s.ok()) return s;
    if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      const pid_t holder = ReadPid(fd.get());
      if (err == EWOULDBLOCK) {
        return absl::FailedPreconditionError(
            absl::StrCat("instance '", instance, "' is in use by hostd pid ",
                         holder > 0 ? absl::StrCat(holder) : std::string("(unknown)"), " (lock ",
                         path, "); stop it or choose another --instance"));
      }
      return ErrnoError("flock " + path, err);
    }
    struct stat named;
    if (lstat(path.c_str(), &named) != 0 || held.st_ino != named.st_ino ||
        held.st_dev != named.st_dev) {
      continue;  // unlinked by its previous owner after we opened it: lock the new one
    }
    // The group first: a group-accessible mode must never apply to the creator's own group.
    if (options.group != static_cast<gid_t>(-1) &&
        fchown(fd.get(), static_cast<uid_t>(-1), options.group) != 0) {
      const int err = errno;
      return ErrnoError(absl::StrCat("fchown ", path, " to ", DescribeGid(options.group),
                                     " (shm_group: hostd must be root or a member of the group)"),
                        err);
    }
    if (fchmod(fd.get(), options.mode) != 0) {
      const int err = errno;
      return ErrnoError("fchmod " + path, err);
    }
    const std::string pid = absl::StrCat(getpid(), "\n");
    if (ftruncate(fd.get(), 0) != 0 ||
        pwrite(fd.get(), pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
      const int err = errno;
      return ErrnoError("write " + path, err);
    }
    return std::unique_ptr<InstanceLock>(
        new InstanceLock(instance, std::move(fd), options.mode, options.group));
  }
  return absl::UnavailableError(absl::StrCat("lock ", path, ": kept changing; try again"));
}

InstanceLock::~InstanceLock() {
  if (fd_.valid()) {
    // Only the file we hold: the name refers to it unless its owner or root replaced it. It is
    // unlinked before fd_ closes (which unlocks it).
    const std::string path = InstanceLockPath(instance_);
    struct stat held, named;
    if (fstat(fd_.get(), &held) == 0 && lstat(path.c_str(), &named) == 0 &&
        held.st_ino == named.st_ino && held.st_dev == named.st_dev) {
      unlink(path.c_str());
    }
  }
}

pid_t InstanceLockHolder(const std::string& instance) {
  if (!ValidInstance(instance)) return 0;
  const UniqueFd fd(
      open(InstanceLockPath(instance).c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (!fd.valid()) return 0;
  pid_t holder = 0;
  if (flock(fd.get(), LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
    holder = ReadPid(fd.get());
    if (holder <= 0) holder = -1;
  }
  return holder;
}

absl::StatusOr<std::vector<InstanceFiles>> ListInstanceFiles(const std::string& instance,
                                                             const std::string& dir) {
  if (!instance.empty()) {
    if (absl::Status s = CheckInstance(instance); !s.ok()) return s;
  }
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return ErrnoError("opendir " + dir, errno);
  std::map<std::string, InstanceFiles> by_instance;
  while (dirent* e = readdir(d)) {
    const absl::string_view name(e->d_name);
    if (!absl::StartsWith(name, kPrefix)) continue;
    const size_t dot = name.rfind('.');
    if (dot <= kPrefix.size()) continue;
    const absl::string_view inst = name.substr(kPrefix.size(), dot - kPrefix.size());
    const absl::string_view suffix = name.substr(dot + 1);
    if (!ValidInstance(inst) ||
        std::find(std::begin(kSuffixes), std::end(kSuffixes), suffix) == std::end(kSuffixes)) {
      continue;
    }
    if (!instance.empty() && inst != instance) continue;
    struct stat st;
    if (lstat(absl::StrCat(dir, "/", name).c_str(), &st) != 0) continue;  // removed meanwhile
    InstanceFiles& f = by_instance[std::string(inst)];
    f.instance = std::string(inst);
    f.files.push_back(
        {std::string(name), static_cast<uint64_t>(st.st_size), st.st_uid, st.st_gid, st.st_mode});
    f.bytes += static_cast<uint64_t>(st.st_size);
  }
  closedir(d);
  std::vector<InstanceFiles> out;
  for (auto& [inst, f] : by_instance) {
    std::sort(f.files.begin(), f.files.end(),
              [](const InstanceFile& a, const InstanceFile& b) { return a.name < b.name; });
    const bool has_lock = std::any_of(f.files.begin(), f.files.end(), [](const InstanceFile& x) {
      return absl::EndsWith(x.name, ".lock");
    });
    f.live_pid = has_lock ? InstanceLockHolder(inst) : LegacyLivePid(inst);
    out.push_back(std::move(f));
  }
  return out;
}

OwnerCheck CleanupOwnerCheck() {
  OwnerCheck c{OwnerCheck::kAnyUid, 07777, OwnerCheck::kAnyGid};
  if (geteuid() != 0) c.uid = geteuid();
  return c;
}

absl::StatusOr<InstanceFiles> RemoveStaleInstance(const std::string& instance,
                                                  const OwnerCheck& check) {
  if (absl::Status s = CheckInstance(instance); !s.ok()) return s;
  struct stat st;
  const bool had_lock_file = lstat(InstanceLockPath(instance).c_str(), &st) == 0;
  const uint64_t lock_file_bytes = had_lock_file ? static_cast<uint64_t>(st.st_size) : 0;
  if (!had_lock_file) {
    if (const pid_t pid = LegacyLivePid(instance); pid != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("instance '", instance, "' is in use by hostd pid ", pid,
                       " (its control segment names that live process); not removed"));
    }
  }
  InstanceLock::Options lock_options;
  lock_options.check = check;
  auto lock = InstanceLock::Acquire(instance, lock_options);
  if (!lock.ok()) return lock.status();
  auto listed = ListInstanceFiles(instance);
  if (!listed.ok()) return listed.status();
  // Every file first: one that is not ours leaves the instance as it is.
  for (const InstanceFiles& f : *listed) {
    for (const InstanceFile& file : f.files) {
      if (absl::EndsWith(file.name, ".lock")) continue;  // checked by Acquire
      auto ours = CheckPath(absl::StrCat(kShmDir, "/", file.name), "segment", check);
      if (!ours.ok()) return ours.status();
    }
  }
  InstanceFiles removed;
  removed.instance = instance;
  for (const InstanceFiles& f : *listed) {
    for (const InstanceFile& file : f.files) {
      if (absl::EndsWith(file.name, ".lock")) {
        // Ours now (it goes when the lock is released below); reported when a dead owner left
        // it, with the size it had then.
        if (!had_lock_file) continue;
        InstanceFile lock_file = file;
        lock_file.bytes = lock_file_bytes;
        removed.files.push_back(lock_file);
        removed.bytes += lock_file_bytes;
        continue;
      }
      if (absl::Status s = ShmSegment::Remove(file.name, check); !s.ok()) return s;
      removed.files.push_back(file);
      removed.bytes += file.bytes;
    }
  }
  lock->reset();  // unlinks the lock file
  return removed;
}

}  // namespace slidedp
