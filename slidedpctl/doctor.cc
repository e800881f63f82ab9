// slidedpctl doctor: see estimate.h.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "slidedpctl/estimate.h"
#include "slidedpctl/format.h"
#include "slidedpctl/table.h"

namespace slidedp::ctl {

std::vector<DoctorCheck> RunDoctor(const MachineInfo& m, bool is_root) {
  std::vector<DoctorCheck> checks;
  auto add = [&checks](std::string key, std::string verdict, std::string value,
                       std::string advice) {
    checks.push_back(
        DoctorCheck{std::move(key), std::move(verdict), std::move(value), std::move(advice)});
  };

  if (m.have_meminfo) {
    add("memory", kDoctorOk,
        absl::StrCat("MemTotal ", FormatBytes(m.mem_total), ", MemAvailable ",
                     FormatBytes(m.mem_available)),
        "hostd needs about 14 B per parameter plus gradient rings, and with checkpoints up to "
        "12 B more for the snapshot pool (sized from MemAvailable, allocated after the first "
        "step and kept); see 'slidedpctl estimate'.");
  } else {
    add("memory", kDoctorFail, "/proc/meminfo unreadable",
        "Run on Linux with /proc mounted; hostd sizes its state from host memory.");
  }

  if (!m.have_memlock) {
    add("memlock", kDoctorWarn, "unknown (getrlimit or /dev/shm failed)",
        "Set LimitMEMLOCK=infinity in hostd's unit or run 'ulimit -l unlimited' before hostd.");
  } else if (m.memlock_unlimited) {
    add("memlock", kDoctorOk,
        m.memlock_by_capability ? absl::StrCat("unlimited (CAP_IPC_LOCK; RLIMIT_MEMLOCK ",
                                               FormatBytes(m.memlock_rlimit), " does not apply)")
                                : std::string("unlimited"),
        m.memlock_by_capability
            ? "hostd run like this (with CAP_IPC_LOCK) can mlock all of its shared memory; "
              "a hostd of another user without it needs LimitMEMLOCK=infinity."
            : "hostd can mlock all of its shared memory.");
  } else if (m.have_meminfo && m.memlock_limit >= m.mem_total) {
    add("memlock", kDoctorOk, FormatBytes(m.memlock_limit),
        "The limit covers all of host memory, so hostd can mlock its shared memory.");
  } else {
    add("memlock", kDoctorWarn,
        absl::StrCat(
            FormatBytes(m.memlock_limit),
            m.have_meminfo ? absl::StrCat(" (< MemTotal ", FormatBytes(m.mem_total), ")") : "",
            is_root ? "; this root process lacks CAP_IPC_LOCK, so it is bound by it" : ""),
        "hostd mlocks all its shared memory (mlock=required): set LimitMEMLOCK=infinity in "
        "hostd's systemd unit or run 'ulimit -l unlimited' first.");
  }

  if (!m.have_dev_shm) {
    add("dev_shm", kDoctorFail, "/dev/shm not found",
        "hostd keeps its state in POSIX shared memory: mount a tmpfs at /dev/shm.");
  } else if (m.have_meminfo && m.dev_shm_size * 2 < m.mem_total) {
    add("dev_shm", kDoctorWarn,
        absl::StrCat(FormatBytes(m.dev_shm_size), " (", FormatBytes(m.dev_shm_free),
                     " free; < 50% of MemTotal ", FormatBytes(m.mem_total), ")"),
        "Large models may not fit: 'mount -o remount,size=90% /dev/shm' (or set the container's "
        "--shm-size).");
  } else {
    add("dev_shm", kDoctorOk,
        absl::StrCat(FormatBytes(m.dev_shm_size), " (", FormatBytes(m.dev_shm_free), " free)"),
        "Room for hostd's shared memory up to the free space shown.");
  }

  if (m.thp_mode.empty()) {
    add("transparent_hugepages", kDoctorOk, "not available",
        "Nothing to do: hostd works with regular pages.");
  } else if (m.thp_mode == "always") {
    add("transparent_hugepages", kDoctorWarn, m.thp_mode,
        "'always' can cause compaction latency spikes; 'madvise' or 'never' are fine for hostd.");
  } else {
    add("transparent_hugepages", kDoctorOk, m.thp_mode,
        "'madvise' and 'never' are fine for hostd.");
  }

  if (m.numa_nodes.empty()) {
    add("numa", kDoctorOk, "no NUMA information (one node assumed)",
        "hostd places its state on one node; nothing to do.");
  } else {
    std::vector<std::string> parts;
    for (const NumaNode& n : m.numa_nodes) {
      parts.push_back(absl::StrCat("node", n.id, " ", n.cpus, " cpus"));
    }
    add("numa", kDoctorOk,
        absl::StrCat(m.numa_nodes.size(), " node", m.numa_nodes.size() == 1 ? "" : "s", ": ",
                     absl::StrJoin(parts, ", ")),
        m.numa_nodes.size() == 1
            ? "One node: no placement to choose."
            : "hostd picks the node nearest the GPUs (numa_node=auto); pin it with numa_node if "
              "needed.");
  }

  if (!m.have_meminfo) {
    add("hugepages", kDoctorWarn, "unknown", "Could not read HugePages_* from /proc/meminfo.");
  } else {
    const uint64_t reserved = m.hugepages_total * m.hugepage_size;
    const std::string value =
        absl::StrCat(m.hugepages_total, " total, ", m.hugepages_free, " free (",
                     FormatBytes(m.hugepage_size), " pages, ", FormatBytes(reserved), " reserved)");
    if (reserved * 4 > m.mem_total) {
      add("hugepages", kDoctorWarn, value,
          "Over 25% of memory is reserved as hugepages, which hostd's shared memory does not use; "
          "lower vm.nr_hugepages unless something else needs them.");
    } else {
      add("hugepages", kDoctorOk, value, "hostd does not need reserved hugepages.");
    }
  }

  if (!m.nvidia_driver) {
    add("gpus", kDoctorOk, "no NVIDIA driver: CPU-only",
        "Ranks can still run on CPU; install the NVIDIA driver for GPU ranks.");
  } else if (m.gpus.empty()) {
    add("gpus", kDoctorWarn, "NVIDIA driver loaded but no GPUs listed",
        "Check 'nvidia-smi' and the driver's kernel messages.");
  } else {
    add("gpus", kDoctorOk, absl::StrCat(m.gpus.size(), ": ", absl::StrJoin(m.gpus, "; ")),
        "Run one rank per GPU; world_size should not exceed this count.");
  }

  {
    std::string value = absl::StrCat(m.cpus_online, " online");
    if (m.cpus_affinity > 0)
      absl::StrAppend(&value, ", ", m.cpus_affinity, " in this affinity mask");
    if (m.cpus_online <= 0) {
      add("cpus", kDoctorWarn, value, "Could not count CPUs.");
    } else if (m.cpus_affinity > 0 && m.cpus_affinity < m.cpus_online) {
      add("cpus", kDoctorWarn, value,
          "This shell is restricted to a CPU subset; hostd's update threads inherit the mask.");
    } else {
      add("cpus", kDoctorOk, value, "hostd uses the cores of its NUMA node for the optimizer.");
    }
  }
  return checks;
}

bool DoctorFailed(const std::vector<DoctorCheck>& checks) {
  return std::any_of(checks.begin(), checks.end(),
                     [](const DoctorCheck& c) { return c.verdict == kDoctorFail; });
}

nlohmann::ordered_json DoctorToJson(const std::vector<DoctorCheck>& checks) {
  nlohmann::ordered_json j;
  nlohmann::ordered_json items = nlohmann::ordered_json::object();
  bool warn = false;
  for (const DoctorCheck& c : checks) {
    items[c.key] = {{"verdict", c.verdict}, {"value", c.value}, {"advice", c.advice}};
    warn = warn || c.verdict == kDoctorWarn;
  }
  j["checks"] = std::move(items);
  j["verdict"] = DoctorFailed(checks) ? kDoctorFail : (warn ? kDoctorWarn : kDoctorOk);
  return j;
}

void PrintDoctor(const std::vector<DoctorCheck>& checks, std::ostream& out) {
  Table t({{"CHECK"}, {"VERDICT"}, {"VALUE"}, {"ADVICE"}});
  for (const DoctorCheck& c : checks) t.AddRow({c.key, c.verdict, c.value, c.advice});
  t.Print(out);
  const std::string overall = DoctorToJson(checks)["verdict"].get<std::string>();
  out << "overall: " << overall << '\n';
}

}  // namespace slidedp::ctl
