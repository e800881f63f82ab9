#include "common/instance_files.h"

#include <dirent.h>
#include <fcntl.h>
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
  auto seg = ShmSegment::Open(absl::StrCat(kPrefix, instance, ".control"), /*writable=*/false);
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

absl::StatusOr<std::unique_ptr<InstanceLock>> InstanceLock::Acquire(const std::string& instance) {
  if (absl::Status s = CheckInstance(instance); !s.ok()) return s;
  const std::string path = InstanceLockPath(instance);
  // A previous owner unlinks the file before it unlocks, so the file we lock may be gone from
  // the directory by the time we hold it: then try again with the new one.
  for (int attempt = 0; attempt < 16; ++attempt) {
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return ErrnoError("open " + path, errno);
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      const pid_t holder = ReadPid(fd);
      close(fd);
      if (err == EWOULDBLOCK) {
        return absl::FailedPreconditionError(
            absl::StrCat("instance '", instance, "' is in use by hostd pid ",
                         holder > 0 ? absl::StrCat(holder) : std::string("(unknown)"), " (lock ",
                         path, "); stop it or choose another --instance"));
      }
      return ErrnoError("flock " + path, err);
    }
    struct stat held, named;
    if (fstat(fd, &held) != 0 || stat(path.c_str(), &named) != 0 || held.st_ino != named.st_ino ||
        held.st_dev != named.st_dev) {
      close(fd);
      continue;
    }
    const std::string pid = absl::StrCat(getpid(), "\n");
    if (ftruncate(fd, 0) != 0 ||
        pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
      const int err = errno;
      close(fd);
      return ErrnoError("write " + path, err);
    }
    return std::unique_ptr<InstanceLock>(new InstanceLock(instance, fd));
  }
  return absl::UnavailableError(absl::StrCat("lock ", path, ": kept changing; try again"));
}

InstanceLock::~InstanceLock() {
  if (fd_ >= 0) {
    unlink(InstanceLockPath(instance_).c_str());
    close(fd_);
  }
}

pid_t InstanceLockHolder(const std::string& instance) {
  if (!ValidInstance(instance)) return 0;
  const int fd = open(InstanceLockPath(instance).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  pid_t holder = 0;
  if (flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
    holder = ReadPid(fd);
    if (holder <= 0) holder = -1;
  }
  close(fd);
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
    if (stat(absl::StrCat(dir, "/", name).c_str(), &st) != 0) continue;  // removed meanwhile
    InstanceFiles& f = by_instance[std::string(inst)];
    f.instance = std::string(inst);
    f.files.push_back({std::string(name), static_cast<uint64_t>(st.st_size)});
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

absl::StatusOr<InstanceFiles> RemoveStaleInstance(const std::string& instance) {
  if (absl::Status s = CheckInstance(instance); !s.ok()) return s;
  struct stat st;
  const bool had_lock_file = stat(InstanceLockPath(instance).c_str(), &st) == 0;
  const uint64_t lock_file_bytes = had_lock_file ? static_cast<uint64_t>(st.st_size) : 0;
  if (!had_lock_file) {
    if (const pid_t pid = LegacyLivePid(instance); pid != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("instance '", instance, "' is in use by hostd pid ", pid,
                       " (its control segment names that live process); not removed"));
    }
  }
  auto lock = InstanceLock::Acquire(instance);
  if (!lock.ok()) return lock.status();
  auto listed = ListInstanceFiles(instance);
  if (!listed.ok()) return listed.status();
  InstanceFiles removed;
  removed.instance = instance;
  for (const InstanceFiles& f : *listed) {
    for (const InstanceFile& file : f.files) {
      if (absl::EndsWith(file.name, ".lock")) {
        // Ours now (it goes when the lock is released below); reported when a dead owner left
        // it, with the size it had then.
        if (!had_lock_file) continue;
        removed.files.push_back({file.name, lock_file_bytes});
        removed.bytes += lock_file_bytes;
        continue;
      }
      if (absl::Status s = ShmSegment::Remove(file.name); !s.ok()) return s;
      removed.files.push_back(file);
      removed.bytes += file.bytes;
    }
  }
  lock->reset();  // unlinks the lock file
  return removed;
}

}  // namespace slidedp
