#include "hostd/topology.h"

#include <hwloc.h>
#include <sched.h>

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace slidedp::hostd {
namespace {

class HwlocTopology {
 public:
  HwlocTopology() = default;
  ~HwlocTopology() {
    if (topo_ != nullptr) hwloc_topology_destroy(topo_);
  }
  HwlocTopology(const HwlocTopology&) = delete;
  HwlocTopology& operator=(const HwlocTopology&) = delete;

  absl::Status Load() {
    if (hwloc_topology_init(&topo_) != 0) return ErrnoStatus("hwloc_topology_init");
    // PCI devices are needed to place GPUs; bridges are kept so locality can be walked up.
    hwloc_topology_set_io_types_filter(topo_, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    if (hwloc_topology_load(topo_) != 0) return ErrnoStatus("hwloc_topology_load");
    return absl::OkStatus();
  }
  hwloc_topology_t get() const { return topo_; }

 private:
  hwloc_topology_t topo_ = nullptr;
};

std::vector<int> CpusOf(hwloc_const_bitmap_t set, const cpu_set_t& allowed) {
  std::vector<int> cpus;
  int i;
  hwloc_bitmap_foreach_begin(i, set) {
    if (i < CPU_SETSIZE && CPU_ISSET(i, &allowed)) cpus.push_back(i);
  }
  hwloc_bitmap_foreach_end();
  return cpus;
}

}  // namespace

absl::StatusOr<Topology> DiscoverTopology() {
  HwlocTopology hw;
  RETURN_IF_ERROR(hw.Load());
  hwloc_topology_t t = hw.get();
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return ErrnoStatus("sched_getaffinity");

  Topology topo;
  const int num_nodes = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
  for (int n = 0; n < std::max(num_nodes, 1); ++n) {
    NumaNodeInfo info;
    hwloc_obj_t node = num_nodes > 0 ? hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, n) : nullptr;
    hwloc_const_cpuset_t node_set =
        node != nullptr ? node->cpuset : hwloc_topology_get_topology_cpuset(t);
    info.os_index = node != nullptr ? static_cast<int>(node->os_index) : 0;
    info.memory_bytes = node != nullptr ? node->attr->numanode.local_memory : 0;
    info.all_cpus = CpusOf(node_set, allowed);
    const int num_cores = hwloc_get_nbobjs_inside_cpuset_by_type(t, node_set, HWLOC_OBJ_CORE);
    for (int c = 0; c < num_cores; ++c) {
      hwloc_obj_t core = hwloc_get_obj_inside_cpuset_by_type(t, node_set, HWLOC_OBJ_CORE, c);
      std::vector<int> pus = CpusOf(core->cpuset, allowed);
      if (!pus.empty()) info.core_cpus.push_back(pus.front());
    }
    if (info.core_cpus.empty()) info.core_cpus = info.all_cpus;
    topo.cores += static_cast<int>(info.core_cpus.size());
    topo.nodes.push_back(std::move(info));
  }

  for (hwloc_obj_t pci = hwloc_get_next_pcidev(t, nullptr); pci != nullptr;
       pci = hwloc_get_next_pcidev(t, pci)) {
    const auto& a = pci->attr->pcidev;
    const unsigned cls = a.class_id >> 8;  // 0x03: display controller (VGA 0x0300, 3D 0x0302)
    if (a.vendor_id != 0x10de || cls != 0x03) continue;
    GpuTopology gpu;
    gpu.pci_bus_id = absl::StrFormat("%04x:%02x:%02x.%x", a.domain, a.bus, a.dev, a.func);
    gpu.name = pci->name != nullptr ? pci->name : "NVIDIA GPU";
    hwloc_obj_t parent = hwloc_get_non_io_ancestor_obj(t, pci);
    if (parent != nullptr && parent->nodeset != nullptr) {
      int first = hwloc_bitmap_first(parent->nodeset);
      gpu.numa_node = hwloc_bitmap_weight(parent->nodeset) == 1 ? first : -1;
    }
    topo.gpus.push_back(std::move(gpu));
  }
  return topo;
}

absl::StatusOr<int> ChooseStateNode(const Topology& topo, int requested) {
  if (topo.nodes.empty()) return absl::FailedPreconditionError("topology has no NUMA node");
  if (requested >= 0) {
    for (const NumaNodeInfo& n : topo.nodes) {
      if (n.os_index == requested) return requested;
    }
    std::string known;
    for (const NumaNodeInfo& n : topo.nodes)
      absl::StrAppend(&known, known.empty() ? "" : ", ", n.os_index);
    return absl::NotFoundError(
        absl::StrCat("numa_node: node ", requested, " does not exist; expected one of ", known));
  }
  std::map<int, int> gpus_per_node;
  for (const GpuTopology& g : topo.gpus) gpus_per_node[g.numa_node]++;
  const NumaNodeInfo* best = &topo.nodes.front();
  auto key = [&](const NumaNodeInfo& n) {
    return std::make_tuple(gpus_per_node[n.os_index], n.memory_bytes, -n.os_index);
  };
  for (const NumaNodeInfo& n : topo.nodes) {
    if (key(n) > key(*best)) best = &n;
  }
  return best->os_index;
}

int AutoUpdateThreads(int node_cores, uint32_t ranks) {
  const int64_t left = int64_t{node_cores} - int64_t{kCoresPerRank} * ranks - kCoresForHostd;
  return static_cast<int>(std::max<int64_t>(1, left));
}

absl::StatusOr<std::vector<int>> WorkerCpus(const Topology& topo, int node, int threads,
                                            uint32_t ranks) {
  const NumaNodeInfo* info = nullptr;
  for (const NumaNodeInfo& n : topo.nodes) {
    if (n.os_index == node) info = &n;
  }
  if (info == nullptr) return absl::NotFoundError(absl::StrCat("numa_node ", node, " not found"));
  if (threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("update_threads: must be >= 0 (0: one per core), got ", threads));
  }
  std::vector<int> order = info->core_cpus;
  for (int cpu : info->all_cpus) {
    if (std::find(order.begin(), order.end(), cpu) == order.end()) order.push_back(cpu);
  }
  if (order.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("numa node ", node, " has no CPU this process may run on"));
  }
  if (threads == 0) {
    threads = std::min(AutoUpdateThreads(static_cast<int>(info->core_cpus.size()), ranks),
                       static_cast<int>(order.size()));
  }
  if (threads > static_cast<int>(order.size())) {
    return absl::InvalidArgumentError(absl::StrCat("update_threads: ", threads, " exceeds the ",
                                                   order.size(), " CPUs of NUMA node ", node));
  }
  order.resize(threads);
  return order;
}

}  // namespace slidedp::hostd
