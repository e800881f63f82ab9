// What slidedpctl's `estimate` and `doctor` read about this machine: /proc/meminfo, the memlock
// limit (CAP_IPC_LOCK or RLIMIT_MEMLOCK), /dev/shm (statvfs), transparent hugepages, NUMA nodes,
// NVIDIA GPUs and CPU counts. No daemon is involved. Every probe that fails leaves its `have_*`
// flag false (never throws). Thread-safe (reads files and calls getrlimit/statvfs/sysconf only).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace slidedp::ctl {

struct NumaNode {
  int id = 0;
  int cpus = 0;  // CPUs in the node's cpulist
};

struct MachineInfo {
  bool have_meminfo = false;  // /proc/meminfo read; sizes below in bytes
  uint64_t mem_total = 0;
  uint64_t mem_available = 0;
  uint64_t hugepages_total = 0;  // HugePages_Total (pages)
  uint64_t hugepages_free = 0;   // HugePages_Free (pages)
  uint64_t hugepage_size = 0;    // Hugepagesize (bytes)

  // What this process may mlock, judged as hostd judges it (common/shm_segment.h
  // ReadHostMemoryInfo): unlimited with CAP_IPC_LOCK or an unlimited RLIMIT_MEMLOCK.
  bool have_memlock = false;  // ReadHostMemoryInfo succeeded
  bool memlock_unlimited = false;
  uint64_t memlock_limit = 0;          // soft RLIMIT_MEMLOCK in bytes (meaningless when unlimited)
  bool memlock_by_capability = false;  // unlimited through CAP_IPC_LOCK despite a finite rlimit
  uint64_t memlock_rlimit = 0;         // that finite soft limit (0: unlimited or unknown)

  bool have_dev_shm = false;  // statvfs("/dev/shm") succeeded
  uint64_t dev_shm_size = 0;
  uint64_t dev_shm_free = 0;  // f_bavail * f_frsize

  std::string thp_mode;  // the [bracketed] word of .../transparent_hugepage/enabled; "" if absent

  std::vector<NumaNode> numa_nodes;  // /sys/devices/system/node/node*; empty if absent

  bool nvidia_driver = false;     // /proc/driver/nvidia/gpus exists
  std::vector<std::string> gpus;  // "<bus id> <model>" per /proc/driver/nvidia/gpus/* entry

  int cpus_online = 0;    // sysconf(_SC_NPROCESSORS_ONLN)
  int cpus_affinity = 0;  // CPUs in this process's affinity mask (0 if unknown)
};

MachineInfo ProbeMachine();

// Number of CPUs in a kernel cpulist such as "0-3,8,10-11" (7); 0 for malformed text.
int CountCpuList(const std::string& text);

// Smallest total memory of the NVIDIA GPUs as reported by `nvidia-smi --query-gpu=memory.total`,
// in bytes; nullopt when nvidia-smi is missing or prints nothing usable.
std::optional<uint64_t> QueryGpuMemory();

// Parses a size: a plain byte count or a number with a binary unit (K, KiB, M, MiB, G, GiB, T,
// TiB, case-insensitive; "80GiB", "80G", "1.5TiB"). nullopt when malformed or zero.
std::optional<uint64_t> ParseByteSize(const std::string& text);

}  // namespace slidedp::ctl
