#include "slidedpctl/machine.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/shm_segment.h"

namespace slidedp::ctl {
namespace {

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void ProbeMeminfo(MachineInfo& m) {
  std::optional<std::string> text = ReadFile("/proc/meminfo");
  if (!text) return;
  bool total = false;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() < 2) continue;
    uint64_t v = 0;
    if (!absl::SimpleAtoi(f[1], &v)) continue;
    const uint64_t scale = (f.size() >= 3 && f[2] == "kB") ? 1024 : 1;
    if (f[0] == "MemTotal:") {
      m.mem_total = v * scale;
      total = true;
    } else if (f[0] == "MemAvailable:") {
      m.mem_available = v * scale;
    } else if (f[0] == "HugePages_Total:") {
      m.hugepages_total = v;
    } else if (f[0] == "HugePages_Free:") {
      m.hugepages_free = v;
    } else if (f[0] == "Hugepagesize:") {
      m.hugepage_size = v * scale;
    }
  }
  m.have_meminfo = total;
}

std::string ThpMode() {
  std::optional<std::string> text = ReadFile("/sys/kernel/mm/transparent_hugepage/enabled");
  if (!text) return "";
  const size_t open = text->find('[');
  const size_t close = text->find(']', open);
  if (open == std::string::npos || close == std::string::npos) {
    return std::string(absl::StripAsciiWhitespace(*text));
  }
  return text->substr(open + 1, close - open - 1);
}

std::vector<NumaNode> ProbeNuma() {
  std::vector<NumaNode> nodes;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/sys/devices/system/node", ec)) {
    const std::string name = entry.path().filename().string();
    int id = 0;
    if (name.rfind("node", 0) != 0 || !absl::SimpleAtoi(name.substr(4), &id)) continue;
    std::optional<std::string> cpulist = ReadFile(entry.path().string() + "/cpulist");
    nodes.push_back(NumaNode{id, cpulist ? CountCpuList(*cpulist) : 0});
  }
  std::sort(nodes.begin(), nodes.end(),
            [](const NumaNode& a, const NumaNode& b) { return a.id < b.id; });
  return nodes;
}

void ProbeGpus(MachineInfo& m) {
  std::error_code ec;
  const std::filesystem::path dir = "/proc/driver/nvidia/gpus";
  if (!std::filesystem::is_directory(dir, ec)) return;
  m.nvidia_driver = true;
  std::vector<std::string> gpus;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::string model;
    if (std::optional<std::string> info = ReadFile(entry.path().string() + "/information")) {
      for (absl::string_view line : absl::StrSplit(*info, '\n')) {
        if (absl::ConsumePrefix(&line, "Model:")) {
          model = std::string(absl::StripAsciiWhitespace(line));
          break;
        }
      }
    }
    gpus.push_back(entry.path().filename().string() + (model.empty() ? "" : " " + model));
  }
  std::sort(gpus.begin(), gpus.end());
  m.gpus = std::move(gpus);
}

}  // namespace

int CountCpuList(const std::string& text) {
  int count = 0;
  for (absl::string_view part :
       absl::StrSplit(absl::StripAsciiWhitespace(text), ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> range = absl::StrSplit(part, '-');
    int lo = 0;
    int hi = 0;
    if (range.size() == 1 && absl::SimpleAtoi(range[0], &lo)) {
      ++count;
    } else if (range.size() == 2 && absl::SimpleAtoi(range[0], &lo) &&
               absl::SimpleAtoi(range[1], &hi) && hi >= lo) {
      count += hi - lo + 1;
    } else {
      return 0;
    }
  }
  return count;
}

MachineInfo ProbeMachine() {
  MachineInfo m;
  ProbeMeminfo(m);
  // hostd's own test (ShmSegment::Create with mlock = required): CAP_IPC_LOCK or an unlimited
  // RLIMIT_MEMLOCK.
  if (absl::StatusOr<HostMemoryInfo> mem = ReadHostMemoryInfo(); mem.ok()) {
    m.have_memlock = true;
    m.memlock_unlimited = mem->memlock_limit_bytes == std::numeric_limits<uint64_t>::max();
    m.memlock_limit = m.memlock_unlimited ? 0 : mem->memlock_limit_bytes;
  }
  struct rlimit rl {};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    m.memlock_rlimit = static_cast<uint64_t>(rl.rlim_cur);
    m.memlock_by_capability = m.memlock_unlimited;
  }
  struct statvfs vfs {};
  if (statvfs("/dev/shm", &vfs) == 0) {
    m.have_dev_shm = true;
    m.dev_shm_size = static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize;
    m.dev_shm_free = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  }
  m.thp_mode = ThpMode();
  m.numa_nodes = ProbeNuma();
  ProbeGpus(m);
  m.cpus_online = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) m.cpus_affinity = CPU_COUNT(&set);
  return m;
}

std::optional<uint64_t> QueryGpuMemory() {
  FILE* pipe =
      popen("nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null", "r");
  if (pipe == nullptr) return std::nullopt;
  std::string output;
  char buf[256];
  while (fgets(buf, sizeof(buf), pipe) != nullptr) output += buf;
  if (pclose(pipe) != 0) return std::nullopt;
  std::optional<uint64_t> smallest;
  for (absl::string_view line : absl::StrSplit(output, '\n', absl::SkipWhitespace())) {
    uint64_t mib = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &mib) || mib == 0) continue;
    const uint64_t bytes = mib << 20;
    smallest = smallest ? std::min(*smallest, bytes) : bytes;
  }
  return smallest;
}

std::optional<uint64_t> ParseByteSize(const std::string& text) {
  std::string t = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  size_t digits = 0;
  while (digits < t.size() &&
         (absl::ascii_isdigit(static_cast<unsigned char>(t[digits])) || t[digits] == '.')) {
    ++digits;
  }
  double value = 0;
  if (digits == 0 || !absl::SimpleAtod(t.substr(0, digits), &value)) return std::nullopt;
  std::string unit(absl::StripAsciiWhitespace(t.substr(digits)));
  if (!unit.empty() && unit.back() == 'b' && unit != "b") unit.pop_back();  // "GiB" -> "gi"
  if (!unit.empty() && unit.back() == 'i') unit.pop_back();                 // "gi" -> "g"
  double scale = 1;
  if (unit.empty() || unit == "b") {
    scale = 1;
  } else if (unit == "k") {
    scale = 1024.0;
  } else if (unit == "m") {
    scale = 1024.0 * 1024;
  } else if (unit == "g") {
    scale = 1024.0 * 1024 * 1024;
  } else if (unit == "t") {
    scale = 1024.0 * 1024 * 1024 * 1024;
  } else {
    return std::nullopt;
  }
  const double bytes = std::floor(value * scale);
  if (!(bytes >= 1) || bytes >= 1.8e19) return std::nullopt;
  return static_cast<uint64_t>(bytes);
}

}  // namespace slidedp::ctl
