#include "common/shm_segment.h"

#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <numaif.h>
#include <pwd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "common/unique_fd.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace slidedp {
namespace bip = boost::interprocess;
namespace {

constexpr uint64_t kUnlimited = std::numeric_limits<uint64_t>::max();

std::string ShmPath(const std::string& name) { return "/dev/shm/" + name; }

std::string Mode(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

std::string FileType(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "a device";
}

bool HasCapIpcLock() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  return (data[CAP_IPC_LOCK / 32].effective & (1u << (CAP_IPC_LOCK % 32))) != 0;
}

absl::Status ValidateName(const std::string& name) {
  if (name.empty() || name.size() > 200 || name.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory name '", name, "' must be 1..200 characters without '/'"));
  }
  return absl::OkStatus();
}

std::string HumanBytes(uint64_t b) { return absl::StrCat(b, " bytes (", b >> 20, " MiB)"); }

absl::Status FromInterprocess(const bip::interprocess_exception& e, absl::string_view what) {
  const int native = e.get_native_error();
  if (native != 0) return ErrnoStatus(what, native);
  if (e.get_error_code() == bip::already_exists_error) {
    return absl::AlreadyExistsError(absl::StrCat(what, ": already exists"));
  }
  if (e.get_error_code() == bip::not_found_error) {
    return absl::NotFoundError(absl::StrCat(what, ": not found"));
  }
  return absl::InternalError(absl::StrCat(what, ": ", e.what()));
}

#if defined(__SANITIZE_THREAD__)
constexpr bool kOneMappingPerFile = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr bool kOneMappingPerFile = true;
#else
constexpr bool kOneMappingPerFile = false;
#endif
#else
constexpr bool kOneMappingPerFile = false;
#endif

// The TSan build's mappings of this process by file (header: TSan keys its shadow state by
// virtual address). Each entry counts the ShmSegments that share it; the last one unmaps.
class MappingRegistry {
 public:
  static MappingRegistry& Get() {
    static MappingRegistry* registry = new MappingRegistry;
    return *registry;
  }
  // The mapping of the file `st` describes, one reference more, when one of st.st_size bytes
  // exists with at least the access asked for; nullptr otherwise.
  void* Share(const struct stat& st, bool writable) {
    absl::MutexLock lock(&mu_);
    for (Entry& e : entries_) {
      if (e.dev == st.st_dev && e.ino == st.st_ino && e.size == static_cast<size_t>(st.st_size) &&
          (e.writable || !writable)) {
        e.refs++;
        return e.addr;
      }
    }
    return nullptr;
  }
  void Add(const struct stat& st, void* addr, size_t size, bool writable) {
    absl::MutexLock lock(&mu_);
    entries_.push_back({st.st_dev, st.st_ino, addr, size, writable, 1});
  }
  // Drops a reference to the mapping at `addr`: true when the caller unmaps it (the last
  // reference, or a mapping never added).
  bool Release(void* addr) {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < entries_.size(); ++i) {
      if (entries_[i].addr != addr) continue;
      if (--entries_[i].refs > 0) return false;
      entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(i));
      return true;
    }
    return true;
  }

 private:
  struct Entry {
    dev_t dev;
    ino_t ino;
    void* addr;
    size_t size;
    bool writable;
    int refs;
  };
  absl::Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
};

// Touches [begin, end) of the mapping so every page is allocated now.
absl::Status Populate(char* base, size_t size, ThreadPool* pool) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  auto populate_range = [&](size_t begin, size_t end) -> int {
    if (begin >= end) return 0;
    if (madvise(base + begin, end - begin, MADV_POPULATE_WRITE) == 0) return 0;
    if (errno == EINVAL) {  // kernel < 5.14: fault the pages in by hand
      for (size_t off = begin; off < end; off += page) {
        *reinterpret_cast<volatile char*>(base + off) = 0;
      }
      return 0;
    }
    return errno;
  };
  if (pool == nullptr) {
    int err = populate_range(0, size);
    return err == 0 ? absl::OkStatus() : ErrnoStatus("madvise(MADV_POPULATE_WRITE)", err);
  }
  std::vector<int> errs(pool->size(), 0);
  pool->ParallelFor(size, page, [&](size_t b, size_t e, int t) { errs[t] = populate_range(b, e); });
  for (int err : errs) {
    if (err != 0) return ErrnoStatus("madvise(MADV_POPULATE_WRITE)", err);
  }
  return absl::OkStatus();
}

}  // namespace

std::string DescribeUid(uid_t uid) {
  struct passwd pw;
  struct passwd* found = nullptr;
  char buf[4096];
  if (getpwuid_r(uid, &pw, buf, sizeof(buf), &found) == 0 && found != nullptr) {
    return absl::StrCat("uid ", uid, " (", found->pw_name, ")");
  }
  return absl::StrCat("uid ", uid);
}

std::string DescribeGid(gid_t gid) {
  struct group gr;
  struct group* found = nullptr;
  char buf[4096];
  if (getgrgid_r(gid, &gr, buf, sizeof(buf), &found) == 0 && found != nullptr) {
    return absl::StrCat("gid ", gid, " (", found->gr_name, ")");
  }
  return absl::StrCat("gid ", gid);
}

OwnerCheck OwnedBySelf(mode_t max_mode, gid_t group) {
  OwnerCheck c;
  c.uid = geteuid();
  c.max_mode = max_mode;
  c.gid = group != static_cast<gid_t>(-1) ? group : getegid();
  return c;
}

absl::Status CheckOwner(const struct stat& st, const std::string& path, absl::string_view what,
                        const OwnerCheck& want) {
  const bool regular = S_ISREG(st.st_mode);
  const bool owner_ok = want.uid == OwnerCheck::kAnyUid || st.st_uid == want.uid;
  const bool mode_ok = (st.st_mode & 07777 & ~want.max_mode) == 0;
  const bool group_ok =
      want.gid == OwnerCheck::kAnyGid || (st.st_mode & 0070) == 0 || st.st_gid == want.gid;
  if (regular && owner_ok && mode_ok && group_ok) return absl::OkStatus();
  std::string expected = "a regular file";
  if (want.uid != OwnerCheck::kAnyUid) {
    absl::StrAppend(&expected, " owned by ", DescribeUid(want.uid));
  }
  if (want.max_mode != 07777) {
    absl::StrAppend(&expected, ", mode ", Mode(want.max_mode), " or narrower");
  }
  if (want.gid != OwnerCheck::kAnyGid && (want.max_mode & 0070) != 0) {
    absl::StrAppend(&expected, ", group ", DescribeGid(want.gid), " when group-accessible");
  }
  // Ours but wider: whoever the mode or group lets in may have written it.
  const std::string why =
      regular && owner_ok
          ? "whoever its mode or group lets in may have written it (were shm_mode or shm_group "
            "changed since it was made?)"
          : "another local user may have placed it there";
  return absl::FailedPreconditionError(absl::StrCat(
      what, " ", path, " is ", FileType(st.st_mode), " owned by ", DescribeUid(st.st_uid),
      ", group ", DescribeGid(st.st_gid), ", mode ", Mode(st.st_mode), "; expected ", expected,
      ". It is left untouched (not used, not removed, a link not followed): ", why,
      "; check who created it, then remove it by hand (rm ", path, ")"));
}

absl::StatusOr<bool> CheckPath(const std::string& path, absl::string_view what,
                               const OwnerCheck& check) {
  // O_PATH: fstat needs no read permission, and with O_NOFOLLOW it opens a link itself.
  const UniqueFd fd(open(path.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno == ENOENT) return false;
    return ErrnoStatus("open " + path);
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return ErrnoStatus("fstat " + path);
  RETURN_IF_ERROR(CheckOwner(st, path, what, check));
  return true;
}

absl::StatusOr<HostMemoryInfo> ReadHostMemoryInfo() {
  HostMemoryInfo info;
  struct statvfs vfs;
  if (statvfs("/dev/shm", &vfs) != 0) return ErrnoStatus("statvfs(/dev/shm)");
  info.shm_free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t value_kib = 0;
  std::string unit;
  while (meminfo >> key >> value_kib) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") info.mem_available_bytes = value_kib * 1024;
  }
  struct rlimit rl;
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return ErrnoStatus("getrlimit(RLIMIT_MEMLOCK)");
  info.memlock_limit_bytes =
      (HasCapIpcLock() || rl.rlim_cur == RLIM_INFINITY) ? kUnlimited : rl.rlim_cur;
  return info;
}

absl::StatusOr<ShmSegment> ShmSegment::Create(const CreateOptions& options) {
  RETURN_IF_ERROR(ValidateName(options.name));
  if (options.size_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment ", options.name, ": size_bytes must be > 0"));
  }
  ASSIGN_OR_RETURN(HostMemoryInfo mem, ReadHostMemoryInfo());
  if (mem.shm_free_bytes < options.size_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "segment ", options.name, " needs ", HumanBytes(options.size_bytes),
        " of /dev/shm but only ", HumanBytes(mem.shm_free_bytes),
        " are free; enlarge /dev/shm (mount -o remount,size=...) or use a smaller model"));
  }
  if (mem.mem_available_bytes != 0 && mem.mem_available_bytes < options.size_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("segment ", options.name, " needs ", HumanBytes(options.size_bytes),
                     " of RAM but MemAvailable is ", HumanBytes(mem.mem_available_bytes)));
  }
  if (options.mlock == MlockPolicy::kRequired && mem.memlock_limit_bytes != kUnlimited) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "segment ", options.name, " must be locked (mlock = required) and needs ",
        HumanBytes(options.size_bytes), " but RLIMIT_MEMLOCK is ",
        HumanBytes(mem.memlock_limit_bytes),
        " and CAP_IPC_LOCK is absent; set LimitMEMLOCK=infinity (systemd), ulimit -l unlimited, "
        "or mlock = best_effort"));
  }

  ShmSegment seg;
  seg.name_ = options.name;
  seg.size_bytes_ = options.size_bytes;
  seg.remove_on_destroy_ = true;  // until Create returns, a failure removes what was made
  try {
    bip::permissions perm(static_cast<int>(options.mode));  // permission bits, <= 07777
    bip::shared_memory_object obj(bip::create_only, options.name.c_str(), bip::read_write, perm);
    const int fd = obj.get_mapping_handle().handle;
    // The group first: a group-readable mode must never apply to the creator's own group.
    if (options.group != static_cast<gid_t>(-1) &&
        fchown(fd, static_cast<uid_t>(-1), options.group) != 0) {
      return ErrnoStatus(absl::StrCat("fchown ", options.name, " to ", DescribeGid(options.group),
                                      " (shm_group: hostd must be root or a member of the group)"));
    }
    // The umask may have cleared bits of the requested mode; set it exactly.
    if (fchmod(fd, options.mode) != 0) return ErrnoStatus("fchmod " + options.name);
    obj.truncate(static_cast<bip::offset_t>(options.size_bytes));
    void* addr = mmap(nullptr, options.size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (addr == MAP_FAILED) return ErrnoStatus("mmap " + options.name);
    seg.data_ = addr;
    if constexpr (kOneMappingPerFile) {
      struct stat st;
      if (fstat(fd, &st) != 0) return ErrnoStatus("fstat " + options.name);
      MappingRegistry::Get().Add(st, addr, options.size_bytes, /*writable=*/true);
    }
  } catch (const bip::interprocess_exception& e) {
    absl::Status s = FromInterprocess(e, "create shared memory " + options.name);
    if (!absl::IsAlreadyExists(s)) ShmSegment::Remove(options.name).IgnoreError();
    seg.remove_on_destroy_ = false;
    return s;
  }

  // The binding must precede the first touch: tmpfs pages take the shared policy when allocated.
  if (options.numa_node >= 0) {
    std::vector<unsigned long> mask((options.numa_node / (8 * sizeof(unsigned long))) + 1, 0);
    mask[options.numa_node / (8 * sizeof(unsigned long))] |=
        1ul << (options.numa_node % (8 * sizeof(unsigned long)));
    if (mbind(seg.data_, seg.size_bytes_, MPOL_BIND, mask.data(),
              mask.size() * 8 * sizeof(unsigned long) + 1, 0) != 0) {
      return ErrnoStatus(absl::StrCat("mbind ", options.name, " to NUMA node ", options.numa_node));
    }
    seg.numa_node_ = options.numa_node;
  }
  absl::Status populated =
      Populate(static_cast<char*>(seg.data_), seg.size_bytes_, options.populate_pool);
  if (!populated.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "segment ", options.name, ": could not allocate ", HumanBytes(options.size_bytes),
        " (/dev/shm or RAM ran out while populating): ", populated.message()));
  }
  if (options.mlock != MlockPolicy::kOff) {
    if (mlock(seg.data_, seg.size_bytes_) == 0) {
      seg.locked_ = true;
    } else if (options.mlock == MlockPolicy::kRequired) {
      const int err = errno;
      return absl::ResourceExhaustedError(absl::StrCat(
          "segment ", options.name, ": mlock of ", HumanBytes(options.size_bytes), " failed: ",
          std::strerror(err), "; raise LimitMEMLOCK / ulimit -l or use mlock = best_effort"));
    }
  }
  seg.remove_on_destroy_ = false;
  return seg;
}

absl::StatusOr<ShmSegment> ShmSegment::Open(const std::string& name, bool writable) {
  RETURN_IF_ERROR(ValidateName(name));
  ShmSegment seg;
  seg.name_ = name;
  try {
    bip::shared_memory_object obj(bip::open_only, name.c_str(),
                                  writable ? bip::read_write : bip::read_only);
    const int fd = obj.get_mapping_handle().handle;
    struct stat st;
    if (fstat(fd, &st) != 0) return ErrnoStatus("fstat " + name);
    if (st.st_size <= 0) return absl::FailedPreconditionError("segment " + name + " is empty");
    seg.size_bytes_ = static_cast<size_t>(st.st_size);
    if constexpr (kOneMappingPerFile) {
      if (void* shared = MappingRegistry::Get().Share(st, writable)) {
        seg.data_ = shared;
        return seg;
      }
    }
    void* addr = mmap(nullptr, seg.size_bytes_, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                      MAP_SHARED, fd, 0);
    if (addr == MAP_FAILED) return ErrnoStatus("mmap " + name);
    seg.data_ = addr;
    if constexpr (kOneMappingPerFile) {
      MappingRegistry::Get().Add(st, addr, seg.size_bytes_, writable);
    }
  } catch (const bip::interprocess_exception& e) {
    return FromInterprocess(e, "open shared memory " + name);
  }
  return seg;
}

absl::StatusOr<ShmSegment> ShmSegment::Open(const std::string& name, bool writable,
                                            const OwnerCheck& check) {
  RETURN_IF_ERROR(ValidateName(name));
  const std::string path = ShmPath(name);
  // O_NOFOLLOW: a link is refused, not followed; O_NONBLOCK: a FIFO in its place cannot block us.
  const UniqueFd fd(
      open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (!fd.valid()) {
    const int err = errno;
    if (err == ENOENT)
      return absl::NotFoundError(absl::StrCat("open shared memory ", name, ": not found"));
    // Say what is there when it is not ours (a link: ELOOP; another user's file: EACCES).
    struct stat st;
    if (lstat(path.c_str(), &st) == 0) RETURN_IF_ERROR(CheckOwner(st, path, "segment", check));
    return ErrnoStatus("open shared memory " + name, err);
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return ErrnoStatus("fstat " + name);
  RETURN_IF_ERROR(CheckOwner(st, path, "segment", check));
  if (st.st_size <= 0) return absl::FailedPreconditionError("segment " + name + " is empty");
  ShmSegment seg;
  seg.name_ = name;
  seg.size_bytes_ = static_cast<size_t>(st.st_size);
  if constexpr (kOneMappingPerFile) {
    if (void* shared = MappingRegistry::Get().Share(st, writable)) {
      seg.data_ = shared;
      return seg;
    }
  }
  void* addr = mmap(nullptr, seg.size_bytes_, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                    MAP_SHARED, fd.get(), 0);
  if (addr == MAP_FAILED) return ErrnoStatus("mmap " + name);
  seg.data_ = addr;
  if constexpr (kOneMappingPerFile) MappingRegistry::Get().Add(st, addr, seg.size_bytes_, writable);
  return seg;
}

absl::Status ShmSegment::CheckExisting(const std::string& name, const OwnerCheck& check) {
  RETURN_IF_ERROR(ValidateName(name));
  return CheckPath(ShmPath(name), "segment", check).status();
}

absl::Status ShmSegment::Lock(MlockPolicy policy) {
  if (policy == MlockPolicy::kOff || locked_ || data_ == nullptr) return absl::OkStatus();
  if (mlock(data_, size_bytes_) == 0) {
    locked_ = true;
  } else if (policy == MlockPolicy::kRequired) {
    const int err = errno;
    return absl::ResourceExhaustedError(absl::StrCat(
        "segment ", name_, ": mlock of ", HumanBytes(size_bytes_), " failed: ", std::strerror(err),
        "; raise LimitMEMLOCK / ulimit -l or use mlock = best_effort"));
  }
  return absl::OkStatus();
}

absl::Status ShmSegment::Remove(const std::string& name) {
  RETURN_IF_ERROR(ValidateName(name));
  if (shm_unlink(("/" + name).c_str()) != 0 && errno != ENOENT) {
    return ErrnoStatus("shm_unlink " + name);
  }
  return absl::OkStatus();
}

absl::Status ShmSegment::Remove(const std::string& name, const OwnerCheck& check) {
  RETURN_IF_ERROR(ValidateName(name));
  // Checked on the file the name refers to, which stays that file until the unlink (sticky
  // /dev/shm). Absent: nothing is unlinked, so a file made meanwhile is not removed unchecked.
  ASSIGN_OR_RETURN(const bool exists, CheckPath(ShmPath(name), "segment", check));
  return exists ? Remove(name) : absl::OkStatus();
}

bool ShmSegment::Exists(const std::string& name) {
  struct stat st;
  return lstat(ShmPath(name).c_str(), &st) == 0;
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    locked_ = std::exchange(other.locked_, false);
    numa_node_ = std::exchange(other.numa_node_, -1);
    remove_on_destroy_ = std::exchange(other.remove_on_destroy_, false);
  }
  return *this;
}

absl::StatusOr<size_t> ShmSegment::ReleasePages(size_t offset, size_t bytes) {
  if (offset > size_bytes_ || bytes > size_bytes_ - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("release of bytes [", offset, ", ", offset + bytes, ") of segment ", name_,
                     ": expected a range within its ", size_bytes_, " bytes"));
  }
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t start = reinterpret_cast<uintptr_t>(data_) + offset;
  const uintptr_t begin = (start + page - 1) / page * page;
  const uintptr_t end = (start + bytes) / page * page;
  if (end <= begin) return 0;
  void* p = reinterpret_cast<void*>(begin);
  const size_t len = end - begin;
  if (locked_) munlock(p, len);
  if (madvise(p, len, MADV_REMOVE) != 0) {
    return absl::InternalError(absl::StrCat("madvise(MADV_REMOVE) of ", len, " bytes of segment ",
                                            name_, ": ", strerror(errno)));
  }
  return len;
}

ShmSegment::~ShmSegment() { Reset(); }

// The mapping is unmapped here rather than by a Mapping (common/mapping.h): under TSan several
// segments share one mapping and only the last reference unmaps it.
void ShmSegment::Reset() {
  if (data_ != nullptr) {
    if (!kOneMappingPerFile || MappingRegistry::Get().Release(data_)) {
      if (locked_) munlock(data_, size_bytes_);
      munmap(data_, size_bytes_);
    }
    data_ = nullptr;
  }
  if (remove_on_destroy_ && !name_.empty()) ShmSegment::Remove(name_).IgnoreError();
  remove_on_destroy_ = false;
  locked_ = false;
}

}  // namespace slidedp
