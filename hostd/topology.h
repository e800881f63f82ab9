// Host topology as hostd needs it: NUMA nodes with their cores, and which node each GPU hangs
// off (when GPUs exist). Discovered with hwloc; a plain struct so tests can build fakes.
//
// Thread safety: DiscoverTopology is reentrant; Topology is a value type.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace slidedp::hostd {

struct NumaNodeInfo {
  int os_index = 0;
  std::vector<int> core_cpus;  // one OS cpu (first PU) per physical core on this node
  std::vector<int> all_cpus;   // every PU on this node
  uint64_t memory_bytes = 0;
};

struct GpuTopology {
  std::string pci_bus_id;  // "0000:17:00.0"
  std::string name;
  int numa_node = -1;
};

struct Topology {
  std::vector<NumaNodeInfo> nodes;  // at least one (a non-NUMA machine is one node, os_index 0)
  std::vector<GpuTopology> gpus;    // NVIDIA display/3D controllers found on the PCI bus
  int cores = 0;
};

// Reads the machine with hwloc (PCI devices included). Only the CPUs this process may run on
// are counted.
absl::StatusOr<Topology> DiscoverTopology();

// The node that should hold the state: `requested` if >= 0 (NOT_FOUND when absent), else the
// node with the most GPUs, ties broken by the most memory, then the lowest index.
absl::StatusOr<int> ChooseStateNode(const Topology& topo, int requested);

// CPUs hostd leaves to each rank process on the node (its Python or native main thread and the
// copy / NCCL progress thread of its GPU data plane) and to its own threads (the gradient
// reducer and the gRPC service), when it picks the number of update threads itself.
inline constexpr int kCoresPerRank = 2;
inline constexpr int kCoresForHostd = 2;

// The number of update threads hostd picks for `node_cores` physical cores and `ranks` rank
// processes: the cores the ranks and hostd's own threads do not need, at least 1. On the H200
// machine (16 cores, one rank) that is 12, the best of the hand-tuned runs of issue #19.
int AutoUpdateThreads(int node_cores, uint32_t ranks);

// The CPUs for `threads` update workers on `node` (0: AutoUpdateThreads of the node's cores
// and `ranks`), one per physical core first, then further PUs. INVALID_ARGUMENT if more threads
// than PUs are asked for.
absl::StatusOr<std::vector<int>> WorkerCpus(const Topology& topo, int node, int threads,
                                            uint32_t ranks);

}  // namespace slidedp::hostd
