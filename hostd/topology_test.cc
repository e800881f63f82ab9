#include "hostd/topology.h"

#include "gtest/gtest.h"

namespace slidedp::hostd {
namespace {

Topology TwoNodes() {
  Topology t;
  t.nodes.push_back(NumaNodeInfo{0, {0, 1, 2, 3}, {0, 1, 2, 3, 8, 9, 10, 11}, 64ull << 30});
  t.nodes.push_back(NumaNodeInfo{1, {4, 5, 6, 7}, {4, 5, 6, 7, 12, 13, 14, 15}, 32ull << 30});
  t.cores = 8;
  return t;
}

TEST(TopologyTest, DiscoversThisMachine) {
  auto topo = DiscoverTopology();
  ASSERT_TRUE(topo.ok()) << topo.status();
  ASSERT_GE(topo->nodes.size(), 1u);
  EXPECT_GE(topo->cores, 1);
  size_t cpus = 0;
  for (const auto& n : topo->nodes) cpus += n.all_cpus.size();
  EXPECT_GE(cpus, static_cast<size_t>(topo->cores));
}

TEST(TopologyTest, ChoosesNodeWithMostGpusThenMemory) {
  Topology t = TwoNodes();
  EXPECT_EQ(*ChooseStateNode(t, -1), 0);  // more memory
  t.gpus.push_back(GpuTopology{"0000:81:00.0", "H200", 1});
  EXPECT_EQ(*ChooseStateNode(t, -1), 1);  // the GPU's node
  EXPECT_EQ(*ChooseStateNode(t, 0), 0);   // explicit request wins
  auto missing = ChooseStateNode(t, 5);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("numa_node"), std::string::npos);
}

TEST(TopologyTest, WorkerCpusOnePerCoreFirst) {
  Topology t = TwoNodes();
  EXPECT_EQ(*WorkerCpus(t, 0, 2, 1), (std::vector<int>{0, 1}));
  EXPECT_EQ(*WorkerCpus(t, 0, 6, 1), (std::vector<int>{0, 1, 2, 3, 8, 9}));
  auto too_many = WorkerCpus(t, 0, 9, 1);
  ASSERT_FALSE(too_many.ok());
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.status().message().find("update_threads"), std::string::npos);
  EXPECT_FALSE(WorkerCpus(t, 3, 1, 1).ok());
  EXPECT_FALSE(WorkerCpus(t, 0, -1, 1).ok());
}

TEST(TopologyTest, AutoUpdateThreadsLeaveCoresToRanksAndHostd) {
  EXPECT_EQ(AutoUpdateThreads(16, 1), 12);  // the H200 machine's best hand-tuned setting
  EXPECT_EQ(AutoUpdateThreads(64, 8), 46);
  EXPECT_EQ(AutoUpdateThreads(4, 1), 1);
  EXPECT_EQ(AutoUpdateThreads(2, 8), 1);                         // never none
  Topology t = TwoNodes();                                       // 4 cores per node
  EXPECT_EQ(*WorkerCpus(t, 1, 0, 0), (std::vector<int>{4, 5}));  // no rank: 4 - 2
  EXPECT_EQ(*WorkerCpus(t, 1, 0, 1), (std::vector<int>{4}));
  EXPECT_EQ(*WorkerCpus(t, 1, 0, 4), (std::vector<int>{4}));
  EXPECT_EQ(*WorkerCpus(t, 1, 3, 4), (std::vector<int>{4, 5, 6}));  // explicit wins
}

}  // namespace
}  // namespace slidedp::hostd
